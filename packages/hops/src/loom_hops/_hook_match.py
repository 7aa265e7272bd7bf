"""Whether a compilation made under one saved-tensor hook pair serves another: by content.

Hook pairs are often made anew for each use (``torch.autograd.graph.save_on_cpu()``
builds two closures every time it is entered), so a compilation is reused under
any pair *equal by content* to the pair it was made with, never only under the
same two objects. Content is: the code, the defaults and the bound ``self``;
then either the closure values (immutable values by value, tensors by metadata,
anything else by identity) or, for hooks the tracer traced, the trace's own
guards evaluated on the new pair's closure and globals (a closure value the
trace never read may differ). ``GraphModule`` hooks compare their graphs'
digests. :func:`pair_mismatch` returns why two pairs differ, or ``None``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx

from loom_hops._hook_pair import HookPair, feed_graph
from loom_sidefx import Roots

__all__ = [
    "HookDifference",
    "HookMismatch",
    "MatchedTraces",
    "function_mismatch",
    "graph_module_digest",
    "pair_mismatch",
    "roots_of",
    "same_value",
    "static_mismatch",
]


class HookDifference(enum.Enum):
    """What differs between the pair a compilation was made with and the active one."""

    #: Hooks are active on one side only.
    PRESENCE = "presence"
    #: GraphModule against Python function, plain function against bound method, ...
    KIND = "kind"
    #: The hooks run different code.
    CODE = "code"
    #: Default argument values differ.
    DEFAULTS = "defaults"
    #: Bound methods of different objects.
    SELF = "self"
    #: A closure value differs (for hooks that were not traced).
    CLOSURE = "closure"
    #: A value the trace read (closure, global, attribute) no longer passes its guard.
    TRACED_VALUE = "traced_value"
    #: An unpack hook with side effects has another closure (they replay on the compiled one's).
    EFFECT_TARGET = "effect_target"
    #: GraphModule hooks with different graphs (or opaque ones that are not the same objects).
    GRAPH = "graph"
    #: Not plain functions, and not the same objects.
    IDENTITY = "identity"


@dataclasses.dataclass(frozen=True, slots=True)
class HookMismatch:
    """Why the active pair cannot reuse a compilation: which hook, what differs, and how."""

    hook: str  # "pack", "unpack" or "pair"
    difference: HookDifference
    detail: str

    def __str__(self) -> str:
        return f"{self.hook}: {self.difference.value} differs ({self.detail})"


def roots_of(fn: Callable[..., Any], args: tuple[Any, ...]) -> Roots:
    """The ``loom_sidefx.Roots`` of calling ``fn(*args)`` (a function or a bound method)."""
    func = fn.__func__ if isinstance(fn, types.MethodType) else fn
    assert isinstance(func, types.FunctionType)
    return Roots(args, func.__globals__, func.__closure__ or ())


def _where(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return str(name) if code is None else f"{name} at {code.co_filename}:{code.co_firstlineno}"


_VALUE_TYPES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def same_value(a: Any, b: Any) -> bool:
    """Content equality of two captured values: immutable data by value, tensors by
    metadata, tuples element-wise, anything else by identity."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _VALUE_TYPES):
        return bool(a == b) or (isinstance(a, float) and a != a and b != b)
    if isinstance(a, (tuple, frozenset)) and type(a) in (tuple, frozenset):
        if len(a) != len(b):
            return False
        if isinstance(a, frozenset):
            return bool(a == b)
        return all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return _tensor_meta(a) == _tensor_meta(b)
    return False


def _tensor_meta(t: torch.Tensor) -> tuple[Any, ...]:
    strides = tuple(t.stride()) if t.layout == torch.strided else None
    return (t.dtype, tuple(t.shape), strides, t.device, t.layout, t.requires_grad)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, _VALUE_TYPES):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__qualname__} object"


_EMPTY = object()


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


def function_mismatch(
    role: str, compiled: Any, active: Any, *, closure_values: bool
) -> HookMismatch | None:
    """Whether ``active`` runs what ``compiled`` runs: code, defaults, bound ``self`` and,
    with ``closure_values``, the closure's values. The same object always matches."""
    if compiled is active:
        return None
    if isinstance(compiled, types.MethodType) and isinstance(active, types.MethodType):
        if compiled.__self__ is not active.__self__:
            return HookMismatch(
                role, HookDifference.SELF, f"bound to another {type(active.__self__).__name__}"
            )
        compiled, active = compiled.__func__, active.__func__
        if compiled is active:
            return None
    if type(compiled) is not type(active):
        return HookMismatch(
            role,
            HookDifference.KIND,
            f"{type(compiled).__name__} {_where(compiled)} vs "
            f"{type(active).__name__} {_where(active)}",
        )
    if not isinstance(compiled, types.FunctionType):
        return HookMismatch(
            role,
            HookDifference.IDENTITY,
            f"a {type(active).__name__} is compared by identity: another object",
        )
    if compiled.__code__ != active.__code__:
        return HookMismatch(role, HookDifference.CODE, f"{_where(compiled)} vs {_where(active)}")
    defaults = (compiled.__defaults__ or (), active.__defaults__ or ())
    kw = (compiled.__kwdefaults__ or {}, active.__kwdefaults__ or {})
    if (
        len(defaults[0]) != len(defaults[1])
        or not all(same_value(a, b) for a, b in zip(*defaults, strict=True))
        or kw[0].keys() != kw[1].keys()
        or not all(same_value(kw[0][k], kw[1][k]) for k in kw[0])
    ):
        return HookMismatch(role, HookDifference.DEFAULTS, _where(active))
    if closure_values:
        names = compiled.__code__.co_freevars
        for name, a, b in zip(
            names, compiled.__closure__ or (), active.__closure__ or (), strict=True
        ):
            va, vb = _cell_value(a), _cell_value(b)
            if not same_value(va, vb):
                return HookMismatch(
                    role, HookDifference.CLOSURE, f"{name}: {_short(va)} vs {_short(vb)}"
                )
    return None


_digests: weakref.WeakKeyDictionary[torch.fx.GraphModule, str | None] = weakref.WeakKeyDictionary()


def graph_module_digest(gm: torch.fx.GraphModule) -> str | None:
    """A content hash of a GraphModule hook (``None``: an opaque call without
    ``user_cache_hash``); computed once per object, as hooks are taken as they are."""
    if gm not in _digests:
        h = hashlib.sha256(b"loom-hook-graph-v1;")
        _digests[gm] = h.hexdigest() if feed_graph(gm, h) else None
    return _digests[gm]


def static_mismatch(compiled: HookPair | None, active: HookPair | None) -> HookMismatch | None:
    """Content comparison of two pairs without traces (see the module docstring)."""
    if compiled is None or active is None:
        if compiled is active:
            return None
        what = "no hooks are active" if active is None else "hooks are active"
        return HookMismatch("pair", HookDifference.PRESENCE, what)
    if compiled.kind != active.kind:
        return HookMismatch("pair", HookDifference.KIND, f"{compiled.kind} vs {active.kind}")
    for role, a, b in (
        ("pack", compiled.pack, active.pack),
        ("unpack", compiled.unpack, active.unpack),
    ):
        if a is b:
            continue
        if isinstance(a, torch.fx.GraphModule) and isinstance(b, torch.fx.GraphModule):
            da, db = graph_module_digest(a), graph_module_digest(b)
            if da is None or da != db:
                why = "another graph" if da is not None else "opaque calls, another object"
                return HookMismatch(role, HookDifference.GRAPH, why)
            continue
        found = function_mismatch(role, a, b, closure_values=True)
        if found is not None:
            return found
    return None


class MatchedTraces(Protocol):
    """Traces that know which pairs they serve (a :class:`loom_hops.HookGraphs`)."""

    def mismatch(self, active: HookPair | None) -> HookMismatch | None: ...


def pair_mismatch(
    compiled: HookPair | None, active: HookPair | None, graphs: MatchedTraces | None = None
) -> HookMismatch | None:
    """Why ``active`` cannot reuse a compilation made under ``compiled``, or ``None``.

    With ``graphs`` (the hooks as that compilation traced them) the traces decide
    which closure and global values matter; without, every closure value does.

    >>> pair_mismatch(HookPair(pack, unpack), HookPair(pack, unpack)) is None
    True
    """
    if graphs is not None:
        return graphs.mismatch(active)
    return static_mismatch(compiled, active)
