"""Sources: how to reach a pre-existing object from a hook's arguments, globals and cells.

A source is a path from a root the hook can see at call time (an argument, a
globals dict, a closure cell) through attributes and items. Guards evaluate
sources on every call and the replay plan writes through them. Roots that are
objects (a globals dict, a cell) are held by identity, never looked up by
``id()``; ``describe()`` is the process-stable text used in fingerprints.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class Source:
    """Base class: a path to a value, evaluable against the hook's call arguments."""

    def describe(self) -> str:
        raise NotImplementedError

    def resolve(self, args: Sequence[Any]) -> Any:
        raise NotImplementedError

    def expr(self, bind: Callable[[object], str]) -> str:
        """Python expression text over ``args``; ``bind`` names an object held by identity."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, slots=True)
class ArgSource(Source):
    """The hook's positional argument ``index``."""

    index: int

    def describe(self) -> str:
        return f"arg{self.index}"

    def resolve(self, args: Sequence[Any]) -> Any:
        return args[self.index]

    def expr(self, bind: Callable[[object], str]) -> str:
        return f"args[{self.index}]"


@dataclass(frozen=True, slots=True)
class GlobalSource(Source):
    """Name ``name`` in a function's globals dict (held by identity)."""

    namespace: dict[str, Any] = field(compare=False, repr=False, hash=False)
    module: str
    name: str

    def describe(self) -> str:
        return f"G[{self.module}].{self.name}"

    def resolve(self, args: Sequence[Any]) -> Any:
        return self.namespace[self.name]

    def expr(self, bind: Callable[[object], str]) -> str:
        return f"{bind(self.namespace)}[{self.name!r}]"


@dataclass(frozen=True, slots=True)
class CellSource(Source):
    """The contents of a closure cell that existed before tracing (held by identity)."""

    cell: types.CellType = field(compare=False, repr=False, hash=False)
    label: str

    def describe(self) -> str:
        return f"cell[{self.label}]"

    def resolve(self, args: Sequence[Any]) -> Any:
        return self.cell.cell_contents

    def expr(self, bind: Callable[[object], str]) -> str:
        return f"{bind(self.cell)}.cell_contents"


@dataclass(frozen=True, slots=True)
class AttrSource(Source):
    """Attribute ``name`` of the object at ``base``."""

    base: Source
    name: str

    def describe(self) -> str:
        return f"{self.base.describe()}.{self.name}"

    def resolve(self, args: Sequence[Any]) -> Any:
        return getattr(self.base.resolve(args), self.name)

    def expr(self, bind: Callable[[object], str]) -> str:
        return f"{self.base.expr(bind)}.{self.name}"


@dataclass(frozen=True, slots=True)
class ItemSource(Source):
    """Item ``key`` (an int or str constant) of the container at ``base``."""

    base: Source
    key: int | str

    def describe(self) -> str:
        return f"{self.base.describe()}[{self.key!r}]"

    def resolve(self, args: Sequence[Any]) -> Any:
        return self.base.resolve(args)[self.key]

    def expr(self, bind: Callable[[object], str]) -> str:
        return f"{self.base.expr(bind)}[{self.key!r}]"


@dataclass(frozen=True, slots=True)
class ObjectSource(Source):
    """A root object held by identity (the hook function itself), described by ``label``."""

    obj: object = field(compare=False, repr=False, hash=False)
    label: str

    def describe(self) -> str:
        return self.label

    def resolve(self, args: Sequence[Any]) -> Any:
        return self.obj

    def expr(self, bind: Callable[[object], str]) -> str:
        return bind(self.obj)
