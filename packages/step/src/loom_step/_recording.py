"""One recording of a step: its capture, in phases, and what a replay needs.

A capture runs in three phases, each a function here: the step's tensor
arguments are copied into static buffers (:func:`static_arguments`), the step is
recorded through the capture core (:func:`record_step`, which restores the
gradients it found if the capture fails), and the result becomes a
:class:`Recording` (:func:`new_recording`): the guard it replays under, the
gradients a replay leaves, the static outputs and the storage use counts that
tell whether the caller still holds one.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

import loom_cudagraph
from loom_step import _torch_compat as compat
from loom_step._fast import NEVER, FastCheck
from loom_step._guard import ANY_TENSOR, StepGuard, StepProbe

__all__ = [
    "Captured",
    "Recording",
    "StaticArgs",
    "new_recording",
    "record_step",
    "static_arguments",
]


@dataclasses.dataclass(slots=True)
class Recording:
    """One capture of the step under one guard set, and what a replay needs."""

    guard: StepGuard
    probe: StepProbe
    graph: Any
    replay: Callable[[], object]
    #: leaf index of each tensor argument, and the buffer the graph reads it from
    arg_idx: list[int]
    bufs: list[torch.Tensor]
    #: the buffers detached (an argument that requires grad has a leaf buffer that does too)
    fill: list[torch.Tensor]
    out_tree: Any
    outs: list[Any]
    #: (position in ``outs``, path to a plain tensor holding its memory, that memory's
    #: storage use count, its baseline) of each tensor output (a ``DTensor``'s memory
    #: is its local tensor's: see ``compat.memory_tensors``)
    out_watch: list[tuple[int, tuple[str, ...], Callable[[], int], int]]
    #: each parameter with what its ``.grad`` is after the step (set after a replay
    #: reached through the full guard, which accepts any gradient where the step replaces it)
    exit_pairs: list[tuple[torch.Tensor, torch.Tensor | None]]
    #: every object the guard names by id, kept alive so that ids stay unique
    held: list[Any]
    #: the per-call check (``None``: arguments in containers go through the full
    #: guard) and the gradients it expects
    fast: FastCheck | None = None
    fast_grads: list[Any] = dataclasses.field(default_factory=list)
    #: the gradients a replay after the fast check must set: those it expects ``None``
    #: and the step leaves a tensor (the first micro-step of an accumulation)
    grad_fix: list[tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(
        default_factory=list
    )
    #: the step returned one tensor (its output needs no unflattening)
    single_output: bool = False
    #: outputs are returned as copies (a view of an earlier alias was held)
    clone_outputs: bool = False
    #: the output tensors handed out by the last replay (weakly: the caller holds them)
    handed: list[weakref.ref[torch.Tensor] | None] = dataclasses.field(default_factory=list)
    #: the positions in ``outs`` of the tensor outputs
    tensor_pos: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class StaticArgs:
    """The step's arguments as a capture reads them: each tensor argument replaced by
    a buffer that a replay copies the call's tensor into."""

    arg_idx: list[int]
    bufs: list[torch.Tensor]
    args: Any
    kwargs: Any


def static_arguments(leaves: Sequence[Any], tree: Any) -> StaticArgs:
    arg_idx = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    bufs = [leaves[i].detach().clone() for i in arg_idx]
    static = list(leaves)
    for i, buf in zip(arg_idx, bufs, strict=True):
        static[i] = buf.requires_grad_(leaves[i].requires_grad)
    args, kwargs = compat.tree_unflatten(static, tree)
    return StaticArgs(arg_idx, bufs, args, kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class Captured:
    """What a capture made: the graph, the outputs (detached: the originals are gone,
    so the storage use counts read next are the outputs' own) and the gradients the
    step found and left."""

    graph: Any
    outs: list[Any]
    out_tree: Any
    single_output: bool
    entry: list[torch.Tensor | None]
    exit_grads: list[torch.Tensor | None]


def record_step(
    capturer: loom_cudagraph.Capturer,
    fn: Callable[..., Any],
    probe: StepProbe,
    static: StaticArgs,
    finish: Callable[[], None] | None = None,
) -> Captured:
    """Record ``fn`` on the static arguments (running nothing on CUDA), then
    ``finish()`` inside the capture (joining side streams back). The parameters'
    gradients are put back as the capture found them if it raises."""
    params = probe.params
    entry = [p.grad for p in params]
    #: the output's structure, and whether it is one tensor (set by the capture's run)
    shape: list[Any] = [None, False]

    def body() -> list[Any]:
        # NOTE: a replay starts from the gradients the capture found. On CUDA this is
        # a no-op (the graph reads their memory); the host stand-in, which runs the
        # body again per replay, needs it.
        for p, e in zip(params, entry, strict=True):
            if p.grad is not e:
                p.grad = e
        out = fn(*static.args, **static.kwargs)
        if finish is not None:
            finish()
        leaves, shape[0] = compat.tree_flatten(out)
        shape[1] = isinstance(out, torch.Tensor)
        del out
        return [*leaves, *(p.grad for p in params)]

    try:
        with loom_cudagraph.suspended():
            graph, values = capturer.capture_call(
                body, capturer.new_pool_handle(), keep=_state_tensors(probe, entry)
            )
    except BaseException:
        for p, g in zip(params, entry, strict=True):
            p.grad = g
        raise
    n_out = len(values) - len(params)
    outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in values[:n_out]]
    exit_grads = values[n_out:]
    del values
    return Captured(graph, outs, shape[0], bool(shape[1]) and n_out == 1, entry, exit_grads)


def _state_tensors(probe: StepProbe, entry: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """What a step's capture must leave as it found it (a CUDA capture runs nothing):
    parameters, buffers, the step's tensors, gradients and optimizer state."""
    targets = probe.targets
    found = [*probe.params, *(g for g in entry if g is not None)]
    found += [b for _, m in targets.modules for b in m.buffers()]
    found += [t for _, t in targets.tensors]
    for _, opt in targets.optimizers:
        for state in opt.state.values():
            found += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return list({id(t): t for t in found}.values())


def new_recording(
    capturer: loom_cudagraph.Capturer,
    current: StepGuard,
    probe: StepProbe,
    static: StaticArgs,
    made: Captured,
    clone_outputs: bool,
) -> Recording:
    """The recording of a capture made under ``current``: its guard accepts any gradient
    where the step replaces the one it finds, and its outputs are watched from here."""
    params = probe.params
    entry, exit_grads = made.entry, made.exit_grads
    # What the next call must find for the fast check: the gradient this replay
    # leaves, or None where the step starts from None; where the step needs a
    # gradient it finds (any tensor) but leaves None, no state after a replay fits.
    fast_grads = [
        None if e is None else NEVER if x is None else x
        for e, x in zip(entry, exit_grads, strict=True)
    ]
    expect = tuple(
        None if e is None else (id(e), compat.address(e)) if x is e else ANY_TENSOR
        for e, x in zip(entry, exit_grads, strict=True)
    )
    rec = Recording(
        guard=dataclasses.replace(current, grads=expect),
        probe=probe,
        graph=made.graph,
        replay=capturer.replayer(made.graph),
        arg_idx=static.arg_idx,
        bufs=static.bufs,
        fill=[b.detach() for b in static.bufs],
        out_tree=made.out_tree,
        outs=made.outs,
        out_watch=[],
        exit_pairs=list(zip(params, exit_grads, strict=True)),
        held=probe.held(),
        fast_grads=fast_grads,
        grad_fix=[
            (p, x)
            for p, f, x in zip(params, fast_grads, exit_grads, strict=True)
            if f is not x and f is not NEVER
        ],
        single_output=made.single_output,
        clone_outputs=clone_outputs,
        handed=[None] * len(made.outs),
    )
    rec.tensor_pos = [k for k, o in enumerate(rec.outs) if isinstance(o, torch.Tensor)]
    counters = [
        (k, path, compat.storage_counter(inner))
        for k in rec.tensor_pos
        for path, inner in compat.memory_tensors(rec.outs[k])
    ]
    rec.out_watch = [(k, path, count, count()) for k, path, count in counters]
    return rec


def protect_outputs(rec: Recording) -> bool:
    """Move each output of the last replay that the caller still holds to fresh
    memory (the replay is about to overwrite the recording's); ``False`` when a
    view of one is held too (it cannot be moved).

    The memory moved is the plain tensor that holds it: the output itself, or the
    inner tensor of a wrapper subclass (a ``DTensor``'s local tensor, as a step that
    returns ``clip_grad_norm_``'s total norm under FSDP2 does), which is moved in place
    so that the caller's wrapper reads the copy."""
    if rec.clone_outputs:
        return True
    moved: list[int] = []
    for pos, path, count, baseline in rec.out_watch:
        extra = count() - baseline
        if extra == 0:
            continue
        ref = rec.handed[pos] if pos < len(rec.handed) else None
        alias = ref() if ref is not None else None
        if alias is None or extra != 1:
            return False
        inner = compat.reach(alias, path)
        with torch.no_grad():
            copy = inner.clone()
            inner.set_(copy.untyped_storage(), copy.storage_offset(), copy.size(), copy.stride())
        moved.append(pos)
    for pos in moved:
        rec.handed[pos] = None
    return True
