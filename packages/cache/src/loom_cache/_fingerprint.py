"""Canonical fingerprints of FX graphs.

A fingerprint hashes a graph's structure, call targets, constants and the
metadata of every value (dtype, shape and stride with symbolic expressions,
device, requires_grad). Nodes are referred to by position, never by name;
symbols are renamed with :func:`stable_symbol_names`; dicts are sorted;
nothing depends on ``id()``, Python's ``hash()`` or the process. Two graphs
that would compile differently get different digests; the same program in
two processes gets the same one.

Calls the tracer could not see into (an ``fx.wrap``-ed function, a
non-graph submodule) are only hashable through ``node.meta["user_cache_hash"]``;
without it the fingerprint carries a :class:`CacheBypass`.
"""

from __future__ import annotations

import builtins
import math
import operator
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx

from loom_cache import _torch_compat
from loom_cache._bypass import CacheBypass, CacheBypassKind
from loom_cache._hashing import (
    UnhashableValue,
    describe_callable,
    function_digest,
    stable_digest,
)
from loom_cache._key import KeyComponent
from loom_cache._symbols import stable_symbol_names

USER_CACHE_HASH = "user_cache_hash"
_TRANSPARENT_MODULES = (builtins, operator, math)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A graph's digest and the components it is made of.

    ``bypass`` is set when the graph must not be cached; the components are
    still computed so that a report can show them.
    """

    digest: str
    components: tuple[KeyComponent, ...]
    symbols: tuple[tuple[str, str], ...] = ()
    bypass: CacheBypass | None = None

    @property
    def cacheable(self) -> bool:
        return self.bypass is None


def graph_fingerprint(gm: torch.fx.GraphModule) -> Fingerprint:
    """Fingerprint ``gm`` (and, recursively, the subgraphs it calls).

    >>> import torch.fx
    >>> fp = graph_fingerprint(torch.fx.symbolic_trace(lambda x: x + 1))
    >>> fp.cacheable, [c.name for c in fp.components]
    (True, ['graph', 'inputs', 'values', 'constants', 'code'])
    """
    return _Canonicalizer(gm).run()


@dataclass
class _Parts:
    graph: list[object] = field(default_factory=list)
    inputs: list[object] = field(default_factory=list)
    values: list[object] = field(default_factory=list)
    constants: list[object] = field(default_factory=list)
    code: list[object] = field(default_factory=list)


class _Canonicalizer:
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.parts = _Parts()
        self.bypass: CacheBypass | None = None
        self.code_details: list[str] = []
        self.symbol_names, self.symbol_sources = _canonical_symbols(gm)

    def run(self) -> Fingerprint:
        index: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(self.gm.graph.nodes):
            index[node] = i
            self._node(node, index)
        components = (
            KeyComponent("graph", stable_digest(self.parts.graph), f"{len(index)} nodes"),
            KeyComponent(
                "inputs", stable_digest(self.parts.inputs), _short(repr(self.parts.inputs))
            ),
            KeyComponent("values", stable_digest(self.parts.values), "metadata of every value"),
            KeyComponent(
                "constants",
                stable_digest(self.parts.constants),
                f"{len(self.parts.constants)} constants",
            ),
            KeyComponent(
                "code", stable_digest(self.parts.code), _short("; ".join(self.code_details))
            ),
        )
        digest = stable_digest([(c.name, c.digest) for c in components])
        symbols = tuple(
            sorted((self.symbol_names[s], src) for s, src in self.symbol_sources.items())
        )
        return Fingerprint(digest, components, symbols, self.bypass)

    def _refuse(self, kind: CacheBypassKind, node: torch.fx.Node, why: str, hint: str) -> None:
        if self.bypass is None:
            where = f"node {node.format_node()}"
            trace = node.meta.get("stack_trace")
            if isinstance(trace, str) and trace.strip():
                # The last 'File "...", line N' entry is the user's code.
                frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File")]
                if frames:
                    where += f" ({frames[-1]})"
            self.bypass = CacheBypass(kind, where, why, hint)

    def _node(self, node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> None:
        op = node.op
        if op == "placeholder":
            self.parts.graph.append(("placeholder", self._default(node)))
            # Parameters and buffers are static inputs (fixed addresses): that changes codegen.
            static = (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
            self.parts.inputs.append((self._meta(node), str(static) if static else None))
        elif op == "output":
            self.parts.graph.append(("output", self._arg(node.args, index, node)))
        elif op == "get_attr":
            self.parts.graph.append(("get_attr", self._attribute(node)))
        else:
            target = self._target(node)
            args = self._arg(node.args, index, node)
            kwargs = self._arg(dict(node.kwargs), index, node)
            self.parts.graph.append((op, target, args, kwargs))
        if op != "placeholder":
            self.parts.values.append(self._meta(node))

    def _default(self, node: torch.fx.Node) -> object:
        return self._arg(node.args, {}, node) if node.args else ()

    def _arg(self, value: object, index: dict[torch.fx.Node, int], node: torch.fx.Node) -> object:
        if isinstance(value, torch.fx.Node):
            return ("%", index[value])
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(self._arg(v, index, node) for v in value))
        if isinstance(value, dict):
            return (
                "dict",
                tuple(sorted((str(k), self._arg(v, index, node)) for k, v in value.items())),
            )
        if isinstance(value, slice):
            return ("slice", self._arg((value.start, value.stop, value.step), index, node))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", self._expr(value.node.expr))
        if value is None or isinstance(value, (bool, int, float, complex, str)):
            return value
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, types.FunctionType) or (
            callable(value) and not isinstance(value, torch.Tensor)
        ):
            return ("callable", self._target_of(value, node))
        try:
            digest = stable_digest(value)
        except UnhashableValue as exc:
            self._refuse(
                CacheBypassKind.UNHASHABLE_CONSTANT,
                node,
                str(exc),
                "pass the value as a tensor input, or give its type a `cache_hash`",
            )
            return ("unhashable", type(value).__qualname__)
        self.parts.constants.append(digest)
        return ("constant", digest)

    def _target(self, node: torch.fx.Node) -> object:
        if node.op == "call_method":
            return ("method", str(node.target))
        if node.op == "call_module":
            sub = self.gm.get_submodule(str(node.target))
            if isinstance(sub, torch.fx.GraphModule):
                return ("subgraph", graph_fingerprint(sub).digest)
            return self._opaque(node, f"submodule {type(sub).__qualname__}")
        return self._target_of(node.target, node)

    def _target_of(self, target: object, node: torch.fx.Node) -> object:
        if _torch_compat.is_op_overload(target):
            self._custom_op_code(target)
            return ("op", str(target))
        if _torch_compat.is_op_packet(target):
            return ("op", str(target))
        if _torch_compat.is_higher_order_op(target):
            return ("hop", _torch_compat.hop_name(target))
        module = getattr(target, "__module__", None) or ""
        name = f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', '?'))}"
        if any(getattr(m, "__name__", "") == module for m in _TRANSPARENT_MODULES) or module in (
            "_operator",
            "builtins",
        ):
            return ("builtin", name)
        if module.partition(".")[0] == "torch" and not _is_fx_wrapped(target):
            return ("torch", name)
        return self._opaque(node, describe_callable(target))

    def _opaque(self, node: torch.fx.Node, what: str) -> object:
        user_hash = node.meta.get(USER_CACHE_HASH)
        if user_hash is None:
            self._refuse(
                CacheBypassKind.OPAQUE_CALL,
                node,
                f"the call to {what} is opaque to the tracer and its node has no "
                f"`{USER_CACHE_HASH}`",
                f'set node.meta["{USER_CACHE_HASH}"] to a string that changes whenever '
                "the function's behaviour changes",
            )
            return ("opaque", what)
        self.parts.code.append(("user_cache_hash", str(user_hash)))
        self.code_details.append(f"{what}: user_cache_hash={user_hash}")
        return ("opaque", what.split(" (")[0], str(user_hash))

    def _custom_op_code(self, op: Any) -> None:
        if op.namespace in ("aten", "prims", "_c10d_functional", "c10d_functional", "inductor"):
            return
        self.parts.code.append(("schema", _torch_compat.op_schema(op)))
        for label, fn in _torch_compat.custom_op_implementations(op):
            try:
                self.parts.code.append((str(op), label, function_digest(fn)))
            except UnhashableValue as exc:
                self.parts.code.append((str(op), label, "unhashable"))
                self.code_details.append(f"{op} {label}: {exc}")
                continue
            self.code_details.append(f"{op} {label}")

    def _attribute(self, node: torch.fx.Node) -> object:
        value = _fetch_attr(self.gm, str(node.target))
        if isinstance(value, torch.fx.GraphModule):
            sub = graph_fingerprint(value)
            if sub.bypass is not None and self.bypass is None:
                self.bypass = sub.bypass
            return ("subgraph", sub.digest)
        if isinstance(value, torch.Tensor):
            if isinstance(value, torch.nn.Parameter) or value.numel() > 4096:
                return ("tensor", self._tensor_meta(value))
        try:
            digest = stable_digest(value)
        except UnhashableValue as exc:
            self._refuse(CacheBypassKind.UNHASHABLE_CONSTANT, node, str(exc), "")
            return ("unhashable", type(value).__qualname__)
        self.parts.constants.append(digest)
        return ("constant", digest)

    def _meta(self, node: torch.fx.Node) -> object:
        value = node.meta.get("val", node.meta.get("example_value"))
        return self._value(value)

    def _value(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            return self._tensor_meta(value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", self._expr(value.node.expr))
        if isinstance(value, (list, tuple)):
            return tuple(self._value(v) for v in value)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value).__qualname__

    def _tensor_meta(self, t: torch.Tensor) -> object:
        strided = t.layout == torch.strided
        return (
            str(t.dtype),
            tuple(self._size(s) for s in t.shape),
            tuple(self._size(s) for s in t.stride()) if strided else (),
            self._size(t.storage_offset()) if strided else 0,
            str(t.device),
            str(t.layout),
            t.requires_grad,
        )

    def _size(self, s: object) -> object:
        if isinstance(s, torch.SymInt):
            return self._expr(s.node.expr)
        return s

    def _expr(self, expr: Any) -> str:
        if not isinstance(expr, sympy.Basic):
            return str(expr)
        mapping = {
            sym: sympy.Symbol(self.symbol_names.get(sym, str(sym)), **sym.assumptions0)
            for sym in expr.free_symbols
        }
        return str(expr.xreplace(mapping))


def _canonical_symbols(gm: torch.fx.GraphModule) -> tuple[dict[Any, str], dict[Any, str]]:
    """Stable names for the free symbols of ``gm``'s values, and their sources."""
    shape_env = None
    ordered: list[Any] = []
    seen: set[Any] = set()
    for value in _node_values(gm):
        if shape_env is None:
            shape_env = _torch_compat.shape_env_of(value)
        for sym in _free_symbols(value):
            if sym not in seen:
                seen.add(sym)
                ordered.append(sym)
    sources: dict[Any, str] = {}
    if shape_env is not None:
        for sym in ordered:
            names = _torch_compat.symbol_source_names(shape_env, sym)
            if names:
                sources[sym] = names[0]
    unsourced = [s for s in ordered if s not in sources]
    return stable_symbol_names(sources, unsourced), sources


def _node_values(gm: torch.fx.GraphModule) -> Iterator[object]:
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, (list, tuple)):
            yield from value
        elif value is not None:
            yield value


def _free_symbols(value: object) -> list[Any]:
    exprs: list[Any] = []
    if isinstance(value, torch.Tensor):
        sizes = [*value.shape]
        if value.layout == torch.strided:
            sizes += [*value.stride(), value.storage_offset()]
        exprs = [s.node.expr for s in sizes if isinstance(s, torch.SymInt)]
    elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        exprs = [value.node.expr]
    out: list[Any] = []
    for expr in exprs:
        if isinstance(expr, sympy.Basic):
            out.extend(sorted(expr.free_symbols, key=str))
    return out


def _fetch_attr(gm: torch.nn.Module, target: str) -> object:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _is_fx_wrapped(target: object) -> bool:
    # torch.fx.wrap records names per module; a wrapped function is opaque even in torch.
    return bool(getattr(target, "__fx_wrapped__", False))


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
