"""Python source generation for the per-call paths: guard checks and replay.

Both run on every compiled call of a hook, so each is generated once as one
straight-line Python function over the hook's :class:`~loom_sidefx.Roots`
(``a`` = args, ``g`` = globals, ``c`` = closure), compiled with ``compile()``.
Every distinct source path is evaluated once into a local; objects (expected
values, classes, keys, code objects) are bound into the function's namespace
by identity, never spelled as text, so the generated text is deterministic.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any

from ._sources import (
    ArgSource,
    AttrSource,
    CellContentsSource,
    ClosureSource,
    FunctionClosureSource,
    GlobalSource,
    ItemSource,
    ObjectSource,
    Source,
)

__all__ = ["Emitter"]

_LITERAL_TYPES = (type(None), bool, int, str)


class Emitter:
    """Accumulates lines of one generated function and the namespace it closes over."""

    def __init__(self, indent: str) -> None:
        self.indent = indent
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {}
        self._consts: dict[int, str] = {}
        self._sources: dict[Source, str] = {}

    def const(self, value: Any) -> str:
        """A name bound to ``value`` (by identity), or a literal for small constants."""
        if type(value) in _LITERAL_TYPES and (type(value) is not str or len(value) < 80):
            return repr(value)
        name = self._consts.get(id(value))
        if name is None:
            name = f"_k{len(self._consts)}"
            self._consts[id(value)] = name
            self.namespace[name] = value
        return name

    def emit(self, line: str) -> None:
        self.lines.append(self.indent + line)

    def source(self, src: Source) -> str:
        """A local holding the value at ``src`` (each path evaluated once)."""
        name = self._sources.get(src)
        if name is not None:
            return name
        if isinstance(src, ArgSource):
            text = f"a[{src.index}]"
        elif isinstance(src, GlobalSource):
            text = f"g[{self.const(src.name)}]"
        elif isinstance(src, ClosureSource):
            text = f"c[{src.index}]"
        elif isinstance(src, ObjectSource):
            text = self.const(src.obj)
        elif isinstance(src, AttrSource):
            base = self.source(src.base)
            plain = src.name.isidentifier() and not keyword.iskeyword(src.name)
            if plain and not src.name.startswith("__"):
                text = f"{base}.{src.name}"
            else:
                text = f"getattr({base}, {self.const(src.name)})"
        elif isinstance(src, ItemSource):
            text = f"{self.source(src.base)}[{self.const(src.key)}]"
        elif isinstance(src, CellContentsSource):
            text = f"{self.source(src.base)}.cell_contents"
        elif isinstance(src, FunctionClosureSource):
            text = f"{self.source(src.base)}.__closure__[{src.index}]"
        else:
            raise TypeError(f"cannot generate code for a {type(src).__qualname__}")
        name = f"s{len(self._sources)}"
        self.emit(f"{name} = {text}")
        self._sources[src] = name
        return name

    def function(
        self, name: str, header: list[str], footer: list[str], filename: str
    ) -> Callable[..., Any]:
        """Compile ``header + lines + footer`` and return the function ``name``."""
        text = "\n".join([*header, *self.lines, *footer]) + "\n"
        self.namespace["__builtins__"] = __builtins__
        exec(compile(text, filename, "exec"), self.namespace)
        fn: Callable[..., Any] = self.namespace[name]
        self.namespace["__loom_source__"] = text
        return fn

    @property
    def text(self) -> str:
        return str(self.namespace.get("__loom_source__", ""))
