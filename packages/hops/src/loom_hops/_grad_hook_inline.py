"""Inline traced ``grad_hook`` hooks into a backward graph; keep their side effects exact.

A backward ``loom.grad_hook(grad, token, site)`` node runs Python hooks. When
the hooks last paired at ``site`` all trace (``trace_hook`` on the gradient's
fake tensor), their tensor work is copied into the backward graph and the node
becomes ``loom.grad_hook_replay(grad, token, site, key, new_grad, values)``.
At run time that op checks each traced hook against the hook *of this call*
(same code, guards true), replays its side effects with this call's closure
and globals, and returns the inlined gradient; from the first hook that does
not match it runs the remaining hooks as Python on the gradient so far.
Invariant: every call does exactly what its own hooks do in eager, whether the
traced graph or the Python hooks produce the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from loom_hops._grad_hooks import (
    GradHook,
    check_hook_result,
    hooks_of,
    last_hooks,
    run_hooks,
)
from loom_hops._torch_compat import FakeTensorMode, fake_mode_of, make_fx
from loom_sidefx import PassResult, Roots, TensorSlot
from loom_tracer import HookUnsupported, TracedHook, trace_hook

__all__ = ["GradHookInlining", "inline_grad_hooks"]

log = logging.getLogger("torchloom.hops")

_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.cudagraph_unsafe)


@dataclasses.dataclass(frozen=True, slots=True)
class _TracedSite:
    """The traced hooks of one site: ``returns[i]`` is hook i's result slot or None.

    ``graphs[i]`` is hook i's graph as inlined (decomposed for the code generator).
    """

    key: str
    hooks: tuple[TracedHook, ...]
    returns: tuple[int | None, ...]
    graphs: tuple[torch.fx.GraphModule, ...]

    @property
    def num_outputs(self) -> tuple[int, ...]:
        return tuple(h.replay.num_tensor_slots for h in self.hooks)


@dataclasses.dataclass(frozen=True, slots=True)
class GradHookInlining:
    """What :func:`inline_grad_hooks` did: the pass result, and per site kept opaque, why."""

    result: PassResult[torch.fx.GraphModule]
    inlined: tuple[int, ...]
    kept_opaque: tuple[tuple[int, str], ...]


#: key -> traced hooks; the key is baked into the backward graph that inlined them.
_traced: dict[str, _TracedSite] = {}
#: keys whose traces this process could not remake from a call's hooks.
_retrace_failed: set[str] = set()


def _plain(fn: GradHook) -> types.FunctionType | None:
    return fn if isinstance(fn, types.FunctionType) else None


Decompositions = Mapping[Any, Callable[..., Any]]


def _decompose(
    graph: torch.fx.GraphModule, grad: torch.Tensor, mode: Any, table: Decompositions | None
) -> torch.fx.GraphModule:
    if not table:
        return graph
    with mode:
        return make_fx(graph, decomposition_table=dict(table))(grad)


def _trace_hooks(
    fns: tuple[GradHook, ...], grad: torch.Tensor
) -> tuple[tuple[TracedHook, ...], tuple[int | None, ...]] | str:
    """Trace ``fns`` in order at ``grad`` (fake); each traced hook and its result slot."""
    hooks: list[TracedHook] = []
    returns: list[int | None] = []
    for fn in fns:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if _plain(fn) is None:
            return f"hook {name} is a {type(fn).__name__}, not a plain Python function"
        traced = trace_hook(fn, (grad,))
        if isinstance(traced, HookUnsupported):
            return f"hook {name}: {traced}"
        if traced.opaque:
            return f"hook {name} calls torch.fx.wrap functions: {', '.join(traced.opaque_calls)}"
        if len(traced.input_sources) != 1:
            return f"hook {name} reads tensors from its closure or globals"
        if any(n.op == "get_attr" for n in traced.graph.graph.nodes):
            return f"hook {name} makes constant tensors"
        if len(traced.replay.results) != 1:
            return f"hook {name} returns more than one value"
        (result,) = traced.replay.results
        if result is None:
            returns.append(None)
        elif isinstance(result, TensorSlot) and result.index < traced.num_user_outputs:
            returns.append(result.index)
        else:
            return f"hook {name} returns something other than a gradient or None"
        hooks.append(traced)
        grad = grad if returns[-1] is None else grad.new_empty(grad.shape)
    return tuple(hooks), tuple(returns)


def _site_key(site: int, hooks: Sequence[TracedHook], returns: Sequence[int | None]) -> str:
    """Content-derived (process-stable): a backward loaded from a cache in another
    process finds its traces again by tracing that call's hooks (:func:`_retrace`)."""
    parts = [f"{h.fingerprint}>{r}" for h, r in zip(hooks, returns, strict=True)]
    return f"site{site}:" + hashlib.sha256(";".join(parts).encode()).hexdigest()[:32]


def _trace_site(
    site: int, grad: torch.Tensor, mode: Any, table: Decompositions | None
) -> _TracedSite | str:
    fns = last_hooks(site)
    if fns is None:
        return (
            "the hooks are not known when the backward is compiled (no forward of this "
            "call site has stored them yet: a backward compiled ahead of time, e.g. one "
            "that saves symbolic sizes)"
        )
    traced = _trace_hooks(fns, grad)
    if isinstance(traced, str):
        return traced
    hooks, returns = traced
    graphs, current = [], grad
    for hook, ret in zip(hooks, returns, strict=True):
        graphs.append(_decompose(hook.graph, current, mode, table))
        current = current if ret is None else current.new_empty(current.shape)
    return _TracedSite(_site_key(site, hooks, returns), hooks, returns, tuple(graphs))


def _retrace(
    key: str, site: int, fns: tuple[GradHook, ...], grad: torch.Tensor
) -> _TracedSite | None:
    """The traces behind ``key``, remade from this call's hooks at ``grad``'s metadata
    (a backward served from the cache in a fresh process); ``None`` if they differ."""
    if key in _retrace_failed:
        return None
    mode = FakeTensorMode()
    traced = _trace_hooks(fns, mode.from_tensor(grad))
    if isinstance(traced, str) or _site_key(site, *traced) != key:
        _retrace_failed.add(key)
        log.debug("grad_hook site %d: this call's hooks do not trace to %s", site, key)
        return None
    entry = _TracedSite(key, traced[0], traced[1], ())
    _traced[key] = entry
    return entry


def _fake_run(node: torch.fx.Node, mode: Any) -> None:
    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]


def _inline_site(
    gm: torch.fx.GraphModule, node: torch.fx.Node, site: int, entry: _TracedSite, mode: Any
) -> None:
    graph = gm.graph
    grad, token = node.args[0], node.args[1]
    assert isinstance(grad, torch.fx.Node)
    current: torch.fx.Node = grad
    values: list[torch.fx.Node] = []
    with graph.inserting_before(node):
        for hook_graph, ret in zip(entry.graphs, entry.returns, strict=True):
            env: dict[torch.fx.Node, Any] = {}
            outputs: tuple[Any, ...] = ()
            for sn in hook_graph.graph.nodes:
                if sn.op == "placeholder":
                    env[sn] = current
                elif sn.op == "output":
                    outputs = tuple(torch.fx.map_arg(sn.args[0], env.__getitem__))
                else:
                    new = graph.node_copy(sn, env.__getitem__)
                    new.meta = {"loom_pass": "inline_grad_hooks"}
                    _fake_run(new, mode)
                    env[sn] = new
            values.extend(outputs)
            if ret is not None:
                current = outputs[ret]
        replay = graph.call_function(
            torch.ops.loom.grad_hook_replay.default,
            (grad, token, site, entry.key, current, values),
        )
    replay.meta["val"] = node.meta["val"]
    replay.meta["loom_pass"] = "inline_grad_hooks"
    node.replace_all_uses_with(replay)
    graph.erase_node(node)


def inline_grad_hooks(
    gm: torch.fx.GraphModule, decompositions: Decompositions | None = None
) -> GradHookInlining:
    """Copy the traced hooks of each ``loom.grad_hook`` node of a backward graph into it.

    ``decompositions`` is the table the graph was traced with (the code
    generator's); the hooks' graphs are decomposed with it before inlining.

    >>> inlining = inline_grad_hooks(bw_gm)   # before codegen, at the first backward
    >>> inlining.kept_opaque                  # ((site, why), ...) left as Python calls
    """
    inlined: list[int] = []
    kept: list[tuple[int, str]] = []
    hook_op = torch.ops.loom.grad_hook.default
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hook_op]:
        grad, site = node.args[0], node.args[2]
        assert isinstance(grad, torch.fx.Node) and isinstance(site, int)
        val = grad.meta.get("val")
        mode = fake_mode_of([val])
        if not isinstance(val, torch.Tensor) or mode is None:
            kept.append((site, "the gradient has no fake tensor to trace the hooks with"))
            continue
        entry = _trace_site(site, val, mode, decompositions)
        if isinstance(entry, str):
            kept.append((site, entry))
            continue
        _traced.setdefault(entry.key, entry)
        _inline_site(gm, node, site, entry, mode)
        inlined.append(site)
    if inlined:
        gm.graph.lint()  # type: ignore[no-untyped-call]
        gm.recompile()
        log.debug("inline_grad_hooks: inlined the hooks of site(s) %s", inlined)
    for site, why in kept:
        log.debug("inline_grad_hooks: site %d stays a Python call: %s", site, why)
    return GradHookInlining(PassResult(gm, bool(inlined)), tuple(inlined), tuple(kept))


def _matches(traced: TracedHook, fn: GradHook, arg: torch.Tensor) -> Roots | None:
    plain = _plain(fn)
    if plain is None or plain.__code__ is not traced.fn.__code__:
        return None
    roots = Roots((arg,), plain.__globals__, plain.__closure__ or ())
    return roots if traced.guard_fn(roots) else None


@torch.library.custom_op("loom::grad_hook_replay", mutates_args=(), tags=_TAGS)
def _replay(
    grad: torch.Tensor,
    token: torch.Tensor,
    site: int,
    key: str,
    new_grad: torch.Tensor,
    values: list[torch.Tensor],
) -> torch.Tensor:
    fns = hooks_of(token)
    entry = _traced.get(key) or _retrace(key, site, fns, grad)
    if entry is None or len(fns) != len(entry.hooks):
        return run_hooks(grad, fns)
    current, offset = grad, 0
    for i, (traced, count) in enumerate(zip(entry.hooks, entry.num_outputs, strict=True)):
        # NOTE: copies: the code generator may reuse these buffers once this op has run,
        # and the side effects may keep them (`sink.append(g.norm())`).
        outputs = tuple(v.clone() for v in values[offset : offset + count])
        offset += count
        roots = _matches(traced, fns[i], current)
        if roots is None:
            log.debug(
                "grad_hook site %d: hook %d does not match its trace: runs as Python", site, i
            )
            return run_hooks(current, fns[i:])
        result = check_hook_result(fns[i], traced.replay.apply(roots, outputs)[0], grad)
        if result is not None:
            current = result
    return new_grad.clone()


@_replay.register_fake
def _replay_fake(
    grad: torch.Tensor,
    token: torch.Tensor,
    site: int,
    key: str,
    new_grad: torch.Tensor,
    values: list[torch.Tensor],
) -> torch.Tensor:
    return torch.empty_like(grad)
