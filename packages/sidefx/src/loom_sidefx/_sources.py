"""Sources: how to reach a pre-existing object from a hook's roots.

A hook's roots are its live argument tuple, its globals dict and its closure
tuple (:class:`Roots`). A :class:`Source` is a frozen path from those roots to
an object; it can be evaluated (:meth:`Source.reconstruct`), compiled into a
closure for repeated evaluation (:meth:`Source.compile`) and described as
deterministic text (:meth:`Source.describe`). Invariant: a source never holds
the object it reaches and never embeds ``id()`` or an address.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

__all__ = [
    "ArgSource",
    "AttrSource",
    "CellContentsSource",
    "ClosureSource",
    "FunctionClosureSource",
    "GlobalSource",
    "ItemSource",
    "ObjectSource",
    "Roots",
    "Source",
]

Getter = Callable[["Roots"], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Roots:
    """The live roots of one hook call: its arguments, globals and closure cells.

    >>> def hook(x): return x
    >>> Roots.of(hook, (1,)).args
    (1,)
    """

    args: tuple[Any, ...]
    globals: dict[str, Any]
    closure: tuple[types.CellType, ...] = ()

    @classmethod
    def of(cls, fn: Callable[..., object], args: tuple[Any, ...]) -> Roots:
        """The roots of calling ``fn(*args)``; ``fn`` is a Python function (``def``, ``lambda``).

        Anything else (a builtin, a bound method, a ``functools.partial``) has no
        globals and closure of its own: ``TypeError`` naming it.
        """
        if not isinstance(fn, types.FunctionType):
            raise TypeError(
                f"Roots.of: {fn!r} ({type(fn).__name__}) is not a Python function; "
                "pass the hook's own def or lambda (for a bound method, its __func__ "
                "with the instance as the first argument)"
            )
        return cls(tuple(args), fn.__globals__, fn.__closure__ or ())


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """A path from :class:`Roots` to an object (abstract)."""

    def reconstruct(self, roots: Roots) -> Any:
        """Evaluate the path on live roots."""
        return self.compile()(roots)

    def compile(self) -> Getter:
        """A closure evaluating the path (built once, called on every replay)."""
        raise NotImplementedError

    def describe(self) -> str:
        """Deterministic text, e.g. ``G['stats'].counts``."""
        raise NotImplementedError

    def root(self) -> Source:
        """The root source this path starts from."""
        return self

    def __str__(self) -> str:
        return self.describe()


@dataclasses.dataclass(frozen=True, slots=True)
class ArgSource(Source):
    """The hook's positional argument number ``index``."""

    index: int

    def compile(self) -> Getter:
        i = self.index
        return lambda roots: roots.args[i]

    def describe(self) -> str:
        return f"args[{self.index}]"


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalSource(Source):
    """The hook's global ``name`` (looked up in its globals dict)."""

    name: str

    def compile(self) -> Getter:
        name = self.name
        return lambda roots: roots.globals[name]

    def describe(self) -> str:
        return f"G[{self.name!r}]"


@dataclasses.dataclass(frozen=True, slots=True)
class ClosureSource(Source):
    """The hook's closure *cell* number ``index`` (free variable ``name``).

    It reaches the cell object itself; wrap it in :class:`CellContentsSource`
    for the value the cell holds.
    """

    index: int
    name: str

    def compile(self) -> Getter:
        i = self.index
        return lambda roots: roots.closure[i]

    def describe(self) -> str:
        return f"closure[{self.index}:{self.name}]"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ObjectSource(Source):
    """A root object held by identity, described by ``label``.

    For roots that are fixed for a given hook but are not its own args, globals
    or closure: the globals dict of another module (``label="globals:mymod"``),
    the hook function itself. Equal only to a source holding the same object
    under the same label.
    """

    obj: Any
    label: str

    def compile(self) -> Getter:
        obj = self.obj
        return lambda roots: obj

    def describe(self) -> str:
        return self.label

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectSource):
            return NotImplemented
        return self.obj is other.obj and self.label == other.label

    def __hash__(self) -> int:
        return hash(("ObjectSource", self.label))


@dataclasses.dataclass(frozen=True, slots=True)
class _Derived(Source):
    base: Source

    def root(self) -> Source:
        return self.base.root()


@dataclasses.dataclass(frozen=True, slots=True)
class AttrSource(_Derived):
    """``base.name``."""

    name: str

    def compile(self) -> Getter:
        get, name = self.base.compile(), self.name
        return lambda roots: getattr(get(roots), name)

    def describe(self) -> str:
        return f"{self.base.describe()}.{self.name}"


@dataclasses.dataclass(frozen=True, slots=True)
class ItemSource(_Derived):
    """``base[key]`` for a constant key (int, str, ... or a tuple of those)."""

    key: Any

    def compile(self) -> Getter:
        get, key = self.base.compile(), self.key
        return lambda roots: get(roots)[key]

    def describe(self) -> str:
        return f"{self.base.describe()}[{self.key!r}]"


@dataclasses.dataclass(frozen=True, slots=True)
class CellContentsSource(_Derived):
    """``base.cell_contents``: the value held by the cell that ``base`` reaches."""

    def compile(self) -> Getter:
        get = self.base.compile()
        return lambda roots: get(roots).cell_contents

    def describe(self) -> str:
        return f"{self.base.describe()}.cell_contents"


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionClosureSource(_Derived):
    """``base.__closure__[index]``: a closure cell of another function (free variable ``name``)."""

    index: int
    name: str

    def compile(self) -> Getter:
        get, i = self.base.compile(), self.index
        return lambda roots: get(roots).__closure__[i]

    def describe(self) -> str:
        return f"{self.base.describe()}.__closure__[{self.index}:{self.name}]"
