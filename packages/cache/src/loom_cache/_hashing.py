"""Process-stable content hashing of Python values, functions and closures.

The invariant: the digest of a value depends only on its content, never on
``id()``, addresses, dict insertion order or Python's salted ``hash()``, so the
same value hashes the same in every process. Functions hash by their bytecode,
constants, names, defaults, closure contents and the globals they read, so
editing a hook's or a custom op's body changes the digest (a stale hit is
worse than a miss). Values with no content-derived hash raise
:class:`UnhashableValue`; callers turn that into a cache bypass.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

# Tensors up to this many elements that a closure or a graph holds as a
# constant are hashed by content; larger ones (weights) by metadata only.
SMALL_TENSOR_NUMEL: Final = 4096
_MAX_DEPTH: Final = 12
_LIBRARY_ROOTS: Final = frozenset(
    {"torch", "functorch", "torchgen", "triton", "sympy", "numpy", "loom_cache", "torchloom"}
)


class UnhashableValue(TypeError):
    """A value has no content-derived, process-stable hash."""


def stable_digest(value: object) -> str:
    """sha256 hex digest of ``value``'s content, equal in every process.

    >>> stable_digest((1, "a", 2.0)) == stable_digest((1, "a", 2.0))
    True
    """
    hasher = _Hasher()
    hasher.feed(value, 0)
    return hasher.hexdigest()


def function_digest(fn: Callable[..., Any]) -> str:
    """Digest of a Python function's behaviour-defining content.

    Two functions get the same digest iff they have the same bytecode,
    constants, names, defaults, closure contents and referenced globals; the
    file name and line numbers do not count, so moving a function is a hit.
    """
    return stable_digest(fn)


def describe_callable(fn: object) -> str:
    """``module.qualname`` (and ``file:line`` when known) for messages."""
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        return f"{module}.{qualname} ({code.co_filename}:{code.co_firstlineno})"
    return f"{module}.{qualname}"


class _Hasher:
    def __init__(self) -> None:
        self._h = hashlib.sha256()
        # ids only detect cycles during one hashing walk; they never reach the digest.
        self._active: set[int] = set()

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def _tag(self, tag: str, payload: bytes = b"") -> None:
        self._h.update(tag.encode() + len(payload).to_bytes(8, "little") + payload)

    def feed(self, value: object, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise UnhashableValue(f"value nested deeper than {_MAX_DEPTH} levels")
        # NOTE: the exact plain types first (configuration mappings are thousands of
        # them per key); each branch writes what the general chain below would.
        kind = type(value)
        if kind is str:
            self._tag("str", value.encode("utf-8", "surrogatepass"))  # type: ignore[attr-defined]
        elif kind is bool:
            self._tag("bool", b"1" if value else b"0")
        elif kind is int:
            self._tag("int", str(value).encode())
        elif kind is dict:
            self._guarded(value, lambda: self._dict(value, depth))  # type: ignore[arg-type]
        elif kind is tuple or kind is list:
            self._tag(kind.__name__, str(len(value)).encode())  # type: ignore[arg-type]
            self._guarded(value, lambda: self._seq(value, depth))
        else:
            self._feed_other(value, depth)

    def _feed_other(self, value: object, depth: int) -> None:
        # NOTE: torch only where this process imported it (no value is a torch object
        # otherwise): hashing plain values, as ``torchloom cache`` does, never imports it.
        torch = sys.modules.get("torch")
        if value is None or value is Ellipsis or value is NotImplemented:
            self._tag("const", repr(value).encode())
        elif isinstance(value, bool):
            self._tag("bool", b"1" if value else b"0")
        elif isinstance(value, enum.Enum):
            self._tag("enum", f"{_qualname(type(value))}.{value.name}".encode())
        elif isinstance(value, int):
            self._tag("int", str(value).encode())
        elif isinstance(value, float):
            self._tag("float", (repr(value) if not math.isnan(value) else "nan").encode())
        elif isinstance(value, complex):
            self._tag("complex", repr(value).encode())
        elif isinstance(value, str):
            self._tag("str", value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, (bytes, bytearray)):
            self._tag("bytes", bytes(value))
        elif torch is not None and isinstance(
            value, (torch.dtype, torch.device, torch.layout, torch.memory_format)
        ):
            self._tag("torch", str(value).encode())
        elif torch is not None and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnhashableValue("a symbolic value outside a graph has no stable content")
        elif torch is not None and isinstance(value, torch.Tensor):
            self._tensor(value)
        elif isinstance(value, slice):
            self._tag("slice")
            self._seq((value.start, value.stop, value.step), depth)
        elif isinstance(value, (tuple, list)):
            self._tag(type(value).__name__, str(len(value)).encode())
            self._guarded(value, lambda: self._seq(value, depth))
        elif isinstance(value, (set, frozenset)):
            digests = sorted(stable_digest(item) for item in value)
            self._tag("set", "".join(digests).encode())
        elif isinstance(value, dict):
            self._guarded(value, lambda: self._dict(value, depth))
        elif isinstance(value, types.FunctionType):
            self._guarded(value, lambda: self._function(value, depth))
        elif isinstance(value, types.MethodType):
            self._tag("method")
            self.feed(value.__func__, depth + 1)
            self.feed(value.__self__, depth + 1)
        elif isinstance(value, types.CodeType):
            self._code(value, depth)
        elif isinstance(value, types.ModuleType):
            self._tag("module", value.__name__.encode())
        elif isinstance(value, type):
            self._tag("class", _qualname(value).encode())
        elif isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self._tag("builtin", _qualname(value).encode())
        elif isinstance(value, types.CellType):
            try:
                contents = value.cell_contents
            except ValueError:
                self._tag("empty-cell")
            else:
                self._tag("cell")
                self.feed(contents, depth + 1)
        elif callable(getattr(value, "cache_hash", None)) or isinstance(
            getattr(value, "cache_hash", None), str
        ):
            user = value.cache_hash  # type: ignore[attr-defined]
            self._tag("user-hash", str(user() if callable(user) else user).encode())
        elif torch is not None and isinstance(value, torch.nn.Module):
            self._tag("nn.Module", _qualname(type(value)).encode())
        elif dataclasses.is_dataclass(value):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            self._tag("dataclass", _qualname(type(value)).encode())
            self._guarded(value, lambda: self._dict(fields, depth))
        elif isinstance(value, (staticmethod, classmethod)):
            self._tag(type(value).__name__)
            self.feed(value.__func__, depth + 1)
        elif hasattr(value, "__dict__") and type(value).__module__ != "builtins":
            # A plain object: its class and its attributes.
            self._tag("object", _qualname(type(value)).encode())
            self._guarded(value, lambda: self._dict(dict(vars(value)), depth))
        else:
            raise UnhashableValue(
                f"no content-derived hash for a {_qualname(type(value))} value; give it a "
                "`cache_hash` attribute (a stable string) to make it cacheable"
            )

    def _guarded(self, value: object, body: Callable[[], None]) -> None:
        key = id(value)
        if key in self._active:
            self._tag("cycle")
            return
        self._active.add(key)
        try:
            body()
        finally:
            self._active.discard(key)

    def _seq(self, items: Any, depth: int) -> None:
        for item in items:
            self.feed(item, depth + 1)

    def _dict(self, mapping: dict[Any, Any], depth: int) -> None:
        items = sorted(((_key_digest(k), v) for k, v in mapping.items()), key=lambda kv: kv[0])
        self._tag("dict", str(len(items)).encode())
        for key_digest, item in items:
            self._tag("key", key_digest.encode())
            self.feed(item, depth + 1)

    def _tensor(self, tensor: torch.Tensor) -> None:
        import torch

        meta = (
            str(tensor.dtype),
            tuple(tensor.shape),
            tuple(tensor.stride()) if tensor.layout == torch.strided else (),
            tensor.device.type,
            tensor.requires_grad,
            isinstance(tensor, torch.nn.Parameter),
        )
        self._tag("tensor", repr(meta).encode())
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
        if plain and tensor.device.type != "meta" and tensor.numel() <= SMALL_TENSOR_NUMEL:
            data = tensor.detach().to("cpu").contiguous().clone()
            self._tag("data", bytes(data.untyped_storage()))

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        if _is_library(fn):
            # Library code is pinned by the versions in the key; hash it by name.
            self._tag("library-function", _qualname(fn).encode())
            return
        self._tag("function", fn.__qualname__.encode())
        self._code(fn.__code__, depth)
        self._tag("defaults")
        self.feed(fn.__defaults__, depth + 1)
        self.feed(fn.__kwdefaults__, depth + 1)
        self._tag("closure")
        for cell in fn.__closure__ or ():
            self.feed(cell, depth + 1)
        self._tag("globals")
        for name in sorted(_global_names(fn.__code__)):
            if name in fn.__globals__:
                self._tag("global", name.encode())
                self.feed(fn.__globals__[name], depth + 1)

    def _code(self, code: types.CodeType, depth: int) -> None:
        self._tag(
            "code",
            repr(
                (
                    code.co_argcount,
                    code.co_posonlyargcount,
                    code.co_kwonlyargcount,
                    code.co_flags,
                    code.co_names,
                    code.co_varnames,
                    code.co_freevars,
                    code.co_cellvars,
                )
            ).encode(),
        )
        self._tag("bytecode", code.co_code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const, depth + 1)
            else:
                self.feed(const, depth + 1)


@functools.lru_cache(maxsize=16384)
def _str_digest(key: str) -> str:
    return stable_digest(key)


def _key_digest(key: object) -> str:
    """A mapping key's digest; string keys (setting names) are remembered per process."""
    return _str_digest(key) if type(key) is str else stable_digest(key)


def _is_library(fn: types.FunctionType) -> bool:
    root = (fn.__module__ or "").partition(".")[0]
    return root in _LIBRARY_ROOTS or root.startswith("loom_") or root in sys.stdlib_module_names


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', repr(obj))}"
