"""Whole-step CUDA graphs: ``torchloom.capture_step(train_step)``.

The step (forward, loss, ``backward()``, ``optimizer.step()``, ``zero_grad()``)
runs eagerly for ``capture_step_warmup`` calls on a side stream, is then
captured as one ``torch.cuda.CUDAGraph`` in its own memory pool, and replayed
per call. A recording replays only while its :class:`~torchloom._step_guard.StepGuard`
holds (arguments, modes, modules, optimizers, gradients); a new guard set gets
one eager call and a new recording, up to ``capture_step_max_recordings``;
beyond that it runs uncaptured with one logged reason. A stale graph is never
replayed. What cannot be captured is refused at warm-up
(:mod:`torchloom._step_refusals`): the step then runs uncaptured, or raises
under ``cudagraph_or_error``.

Invariant of a replay: the Python-visible effect of the step is the captured
one: tensor arguments are copied into the recording's buffers, each
parameter's ``.grad`` is set to what the capture left there (gradients live at
stable addresses), and returned tensors stay intact while the caller holds them
(a held output is moved to fresh memory before the next replay overwrites it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import torch

import loom_cudagraph
from torchloom import _torch_compat as compat
from torchloom._options import LoomOptions, LoomOptionsError, resolve_options
from torchloom._report import GraphRecordBuilder, new_record
from torchloom._step_guard import (
    ANY_TENSOR,
    NEVER,
    FastCheck,
    GuardMismatch,
    StepGuard,
    StepProbe,
    StepTargets,
    find_targets,
    tree_flatten,
    tree_unflatten,
)
from torchloom._step_refusals import (
    CaptureStepError,
    StepRefusalKind,
    StepUnsupported,
    autocast_refusal,
    call_site,
    collect_syncs,
    optimizer_refusals,
    scaler_refusals,
)

__all__ = ["CapturedStep", "CudaStepDevice", "StepDevice", "StepStats", "capture_step"]

log = logging.getLogger("torchloom.capture_step")

#: What ``_replay`` returns when it must not replay (a view of a held output would change).
_HELD: Any = object()

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """How a captured step ran so far (``step.stats()``)."""

    name: str
    warmup_calls: int
    recordings: int
    replays: int
    uncaptured_calls: int
    #: Why the step runs uncaptured for good, if it does.
    refusal: StepUnsupported | None
    #: Why each recording after the first was made (the guard that failed).
    rerecords: tuple[str, ...]
    #: Guard sets that ran uncaptured because the recording budget was spent.
    budget_skips: int

    @property
    def captured(self) -> bool:
        return self.refusal is None and self.recordings > 0

    def format(self) -> str:
        state = "captured" if self.captured else "uncaptured"
        lines = [
            f"capture_step {self.name}: {state}, {self.warmup_calls} warm-up calls, "
            f"{self.recordings} recordings, {self.replays} replays, "
            f"{self.uncaptured_calls} uncaptured calls"
        ]
        if self.refusal is not None:
            lines.append(f"  refused: {self.refusal}")
        lines += [f"  re-recorded: {r}" for r in self.rerecords]
        return "\n".join(lines)


@dataclasses.dataclass(slots=True)
class _Recording:
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
    #: (position in ``outs``, storage use count, its baseline) of each tensor output
    out_watch: list[tuple[int, Callable[[], int], int]]
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


class StepDevice(Protocol):
    """How a step is warmed up, captured and replayed (CUDA; tests pass a host stand-in)."""

    #: the device type whose tensors a capture reads and writes
    type: str

    def available(self) -> bool: ...

    def warm_up(self, fn: Callable[[], Any], syncs: list[StepUnsupported]) -> Any:
        """Run ``fn`` eagerly; append each host synchronization it makes to ``syncs``."""
        ...

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Record ``fn`` (running nothing); return the graph and ``fn``'s result."""
        ...

    def replayer(self, graph: Any) -> Callable[[], object]: ...


class CudaStepDevice:
    """Warm-up on a side stream under CUDA's sync debug mode; capture with
    ``torch.cuda.graph`` into a new memory pool per recording."""

    type = "cuda"

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def available(self) -> bool:
        return torch.cuda.is_available()

    def warm_up(self, fn: Callable[[], Any], syncs: list[StepUnsupported]) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with _watch_syncs(syncs), torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
                out = fn()
        except BaseException:
            # NOTE: torch.cuda.graph's __exit__ leaves its capture stream current
            # when capture_end raises.
            torch.cuda.set_stream(stream)
            raise
        return graph, out

    def replayer(self, graph: Any) -> Callable[[], object]:
        return compat.step_graph_replay(graph)


class CapturedStep(Generic[P, R]):
    """The callable :func:`capture_step` returns; call it as the step itself."""

    def __init__(
        self,
        fn: Callable[P, R],
        options: LoomOptions,
        track: Sequence[Any] = (),
        device: StepDevice | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self._track = tuple(track)
        self._name = getattr(fn, "__qualname__", repr(fn))
        self._targets: StepTargets | None = None
        self._record: GraphRecordBuilder | None = None
        self._recordings: list[_Recording] = []
        self._last: _Recording | None = None
        self._refusal: StepUnsupported | None = None
        #: guard (gradients ignored) of the last eager warm-up call, for re-records
        self._pending: StepGuard | None = None
        self.device: StepDevice = device or CudaStepDevice()
        self._warm = 0
        self._replays = 0
        self._uncaptured = 0
        self._rerecords: list[str] = []
        self._budget_skips = 0
        self._made = 0
        #: return copies of outputs (set once a view of an output was held)
        self._clone_outputs = False
        #: whether the last warm-up call changed Python state the guard reads
        self._changed_last = False
        #: the first host synchronization a warm-up made: the capture is still
        #: tried (code may skip it under capture), and fails naming this one
        self._warm_sync: StepUnsupported | None = None
        #: eager calls made for new guard sets after the first warm-up
        self._extra_warm = 0
        self._last_mismatch: GuardMismatch | None = None
        #: calls that went past the per-call check (the full guard, warm-ups, captures)
        self._slow_calls = 0

    # --- per call ----------------------------------------------------------------------------

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        rec = self._last  # None once refused
        if rec is not None and rec.fast is not None:
            fast = rec.fast
            if kwargs:  # flat keyword arguments: leaves in call order, as pytree's
                leaves: Sequence[Any] = (*args, *kwargs.values())
                ok = tuple(kwargs) == fast.keywords and fast.matches(leaves)
            else:
                leaves = args
                ok = not fast.keywords and fast.matches(args)
            if ok:
                out = self._replay(rec, leaves, rec.grad_fix)
                if out is not _HELD:
                    return out  # type: ignore[no-any-return]
        if self._refusal is not None:
            self._uncaptured += 1
            return self.fn(*args, **kwargs)
        if len(self._recordings) > 1:
            # Another recording's check, from its own last full match, may hold now (the
            # micro-steps of an accumulation, alternating batch shapes): no full guard.
            flat = (*args, *kwargs.values()) if kwargs else args
            names = tuple(kwargs)
            for other in self._recordings:
                check = other.fast
                if other is rec or check is None or check.keywords != names:
                    continue
                if check.matches(flat):
                    self._last = other
                    out = self._replay(other, flat, other.grad_fix)
                    if out is not _HELD:
                        return out  # type: ignore[no-any-return]
                    break
        self._slow_calls += 1
        leaves, tree = tree_flatten((args, kwargs))
        return self._slow(args, kwargs, leaves, tree)

    def _replay(
        self,
        rec: _Recording,
        leaves: Sequence[Any],
        grads: list[tuple[torch.Tensor, torch.Tensor | None]],
    ) -> Any:
        """Replay ``rec`` for these arguments, then set each ``(p, g)`` of ``grads`` as
        ``p.grad = g``; ``_HELD`` when an output of the last replay is held through a
        view that the replay would overwrite."""
        for _, count, baseline in rec.out_watch:
            if count() != baseline:  # an output of the last replay is still referenced
                if not self._protect_outputs(rec):
                    return _HELD
                break
        fill = rec.fill
        if fill:
            if len(fill) == 1:
                fill[0].copy_(leaves[rec.arg_idx[0]])
            else:
                compat.step_foreach_copy_(fill, [leaves[i] for i in rec.arg_idx])
        rec.replay()
        for p, g in grads:
            p.grad = g
        self._replays += 1
        if rec.single_output:
            if rec.clone_outputs:
                return rec.outs[0].clone()
            alias = rec.outs[0].detach()
            rec.handed[0] = weakref.ref(alias)
            return alias
        outs = list(rec.outs)
        handed = rec.handed
        for pos, _, _ in rec.out_watch:
            if rec.clone_outputs:
                outs[pos] = outs[pos].clone()
            else:
                outs[pos] = alias = outs[pos].detach()
                handed[pos] = weakref.ref(alias)
        return tree_unflatten(outs, rec.out_tree)

    def _protect_outputs(self, rec: _Recording) -> bool:
        """Move each output of the last replay that the caller still holds to fresh
        memory (the replay is about to overwrite the recording's); ``False`` when a
        view of one is held too (it cannot be moved)."""
        if rec.clone_outputs:
            return True
        for pos, count, baseline in rec.out_watch:
            extra = count() - baseline
            if extra == 0:
                continue
            ref = rec.handed[pos] if pos < len(rec.handed) else None
            alias = ref() if ref is not None else None
            if alias is None or extra != 1:
                return False
            with torch.no_grad():
                copy = alias.clone()
                alias.set_(
                    copy.untyped_storage(), copy.storage_offset(), copy.size(), copy.stride()
                )
            rec.handed[pos] = None
        return True

    # --- slow paths --------------------------------------------------------------------------

    def _slow(self, args: Any, kwargs: Any, leaves: list[Any], tree: Any) -> R:
        if self._targets is None:
            self._targets = find_targets(self.fn, self._track)
            reason = self._static_refusal(leaves)
            if reason is not None:
                self._refuse(reason)
                return self._eager(args, kwargs)
        probe = StepProbe(self._targets)
        for rec in self._recordings:
            if rec.guard.mismatch(rec.probe.read(leaves, tree)) is None:
                rec.fast = self._fast_check(rec, args, kwargs, leaves)
                self._last = rec
                out = self._replay(rec, leaves, rec.exit_pairs)
                if out is not _HELD:
                    return out  # type: ignore[no-any-return]
                return self._record_again_cloning(rec, args, kwargs, leaves, tree)
        current = probe.read(leaves, tree, named=True)
        ambient = autocast_refusal(self.fn)
        if ambient is not None:
            self._refuse(ambient)
            return self._eager(args, kwargs)
        host = self._host_argument(leaves)
        if host is not None:
            self._refuse(host)
            return self._eager(args, kwargs)
        if self._recordings:
            last = self._recordings[-1]
            self._last_mismatch = last.guard.mismatch(last.probe.read(leaves, tree))
        elif self._pending is not None:
            self._last_mismatch = self._pending.mismatch(current, ignore_grads=True)
        if not self._recordings and self._warm < self.options.capture_step_warmup:
            return self._warm_up(args, kwargs, probe, current, leaves, tree)
        budget = self.options.capture_step_max_recordings
        if len(self._recordings) < budget and any(
            r.guard.mismatch(current, ignore_grads=True) is None for r in self._recordings
        ):
            # Only the gradients differ (accumulation into existing ones, or a first
            # micro-step after zero_grad): nothing compiles anew, capture right away.
            return self._capture(args, kwargs, probe, current, leaves, tree)
        # NOTE: a new guard set gets one eager call (it may compile) before its
        # capture; guard sets that change on every call (a float lr stepped by a
        # scheduler) spend the budget through these calls and never capture.
        if self._pending is None or self._pending.mismatch(current, ignore_grads=True) is not None:
            if self._extra_warm >= budget or len(self._recordings) >= budget:
                self._budget_spent(current)
                return self._eager(args, kwargs)
            self._extra_warm += 1 if self._warm >= self.options.capture_step_warmup else 0
            return self._warm_up(args, kwargs, probe, current, leaves, tree)
        if len(self._recordings) >= budget:
            self._budget_spent(current)
            return self._eager(args, kwargs)
        return self._capture(args, kwargs, probe, current, leaves, tree)

    def _record_again_cloning(
        self, rec: _Recording, args: Any, kwargs: Any, leaves: list[Any], tree: Any
    ) -> R:
        """A view of an output of ``rec`` is held, so ``rec`` may never replay again
        (its static outputs are pinned); record its guard set anew, returning
        copies of the outputs from now on."""
        log.debug("capture_step %s: a view of an output is held; recording again", self._name)
        self._clone_outputs = True
        self._recordings.remove(rec)
        self._last = None
        assert self._targets is not None
        probe = StepProbe(self._targets)
        current = probe.read(leaves, tree, named=True)
        self._last_mismatch = None
        self._rerecords.append("a view of an output was held across calls (outputs are copied now)")
        return self._capture(args, kwargs, probe, current, leaves, tree, again=True)

    def _eager(self, args: Any, kwargs: Any) -> R:
        self._uncaptured += 1
        return self.fn(*args, **kwargs)

    def _static_refusal(self, leaves: Sequence[Any]) -> StepUnsupported | None:
        """Refusals that need no call: no CUDA, optimizers, gradient scalers."""
        assert self._targets is not None
        targets = self._targets
        dev = self.device.type
        on_device = (
            any(isinstance(v, torch.Tensor) and v.device.type == dev for v in leaves)
            or any(p.device.type == dev for p in targets.params())
            or any(t.device.type == dev for _, t in targets.tensors)
        )
        if not self.device.available() or not on_device:
            why = (
                "no CUDA device is available"
                if not self.device.available()
                else ("the step's arguments, parameters and tensors are not on a CUDA device")
            )
            return StepUnsupported(
                StepRefusalKind.NO_CUDA,
                call_site(self.fn, ""),
                f"{why}; the step runs uncaptured",
                "nothing to do: capture_step captures CUDA steps",
                cuda_work=False,
            )
        found = optimizer_refusals(self.fn, targets, dev) + scaler_refusals(self.fn, targets)
        return found[0] if found else None

    def _host_argument(self, leaves: Sequence[Any]) -> StepUnsupported | None:
        for i, v in enumerate(leaves):
            if isinstance(v, torch.Tensor) and v.device.type != self.device.type:
                return StepUnsupported(
                    StepRefusalKind.HOST_ARGUMENT,
                    call_site(self.fn, ""),
                    f"tensor argument leaf {i} is on {v.device}; a replay reads device memory only",
                    "move it to the device before the call (x.cuda(non_blocking=True))",
                )
        return None

    def _warm_up(
        self,
        args: Any,
        kwargs: Any,
        probe: StepProbe,
        before: StepGuard,
        leaves: list[Any],
        tree: Any,
    ) -> R:
        """One eager call on a side stream, watching for host synchronizations and
        for Python state that the step changes (a replay would not).

        A call may change Python state once (an optimizer's lazy state for a new
        parameter); two warm-up calls in a row that change it are refused.
        """
        self._warm += 1
        syncs: list[StepUnsupported] = []
        with loom_cudagraph.suspended():
            out = self.device.warm_up(lambda: self.fn(*args, **kwargs), syncs)
        after = probe.read(leaves, tree, named=True)
        changed = before.mismatch(after, ignore_grads=True)
        if syncs and self._warm_sync is None:
            # NOTE: not a refusal yet. Libraries skip their data-dependent checks
            # while a stream is capturing (transformers' masks test
            # torch.cuda.is_current_stream_capturing()), so the capture is tried;
            # a sync there fails it, and the refusal names this one.
            self._warm_sync = syncs[0]
            log.debug("capture_step %s: a warm-up synchronized: %s", self._name, syncs[0])
        if changed is not None and self._changed_last:
            self._refuse(_python_state(self.fn, changed))
        self._changed_last = changed is not None
        self._pending = after
        return out  # type: ignore[no-any-return]

    def _capture(
        self,
        args: Any,
        kwargs: Any,
        probe: StepProbe,
        current: StepGuard,
        leaves: list[Any],
        tree: Any,
        again: bool = False,
    ) -> R:
        """Capture the step under ``current``'s guard set, then replay it once for
        this call (a capture runs nothing)."""
        arg_idx = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        bufs = [leaves[i].detach().clone() for i in arg_idx]
        static = list(leaves)
        for i, buf in zip(arg_idx, bufs, strict=True):
            static[i] = buf.requires_grad_(leaves[i].requires_grad)
        s_args, s_kwargs = tree_unflatten(static, tree)
        params = probe.params
        entry = [p.grad for p in params]
        try:
            with loom_cudagraph.suspended():
                graph, out = self.device.capture(lambda: self.fn(*s_args, **s_kwargs))
        except RuntimeError as exc:
            for p, g in zip(params, entry, strict=True):
                p.grad = g
            self._refuse(
                self._warm_sync
                or StepUnsupported(
                    StepRefusalKind.CAPTURE_FAILED,
                    call_site(self.fn, ""),
                    f"torch.cuda.graph capture raised {type(exc).__name__}: {exc}",
                    "run it with TORCHLOOM_LOG=debug and report the op",
                )
            )
            return self._eager(args, kwargs)
        except BaseException:
            for p, g in zip(params, entry, strict=True):
                p.grad = g
            raise
        exit_grads = [p.grad for p in params]
        # What the next call must find for the fast check: the gradient this replay
        # leaves, or None where the step starts from None; where the step needs a
        # gradient it finds (any tensor) but leaves None, no state after a replay fits.
        fast_grads = [
            None if e is None else NEVER if x is None else x
            for e, x in zip(entry, exit_grads, strict=True)
        ]
        out_single = isinstance(out, torch.Tensor)
        out_leaves, out_tree = tree_flatten(out)
        del out
        expect = tuple(
            None if e is None else (id(e), e.data_ptr()) if x is e else ANY_TENSOR
            for e, x in zip(entry, exit_grads, strict=True)
        )
        outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
        del out_leaves
        rec = _Recording(
            guard=dataclasses.replace(current, grads=expect),
            probe=probe,
            graph=graph,
            replay=self.device.replayer(graph),
            arg_idx=arg_idx,
            bufs=bufs,
            fill=[b.detach() for b in bufs],
            out_tree=out_tree,
            outs=outs,
            out_watch=[],
            exit_pairs=list(zip(params, exit_grads, strict=True)),
            held=probe.held(),
            fast_grads=fast_grads,
            grad_fix=[
                (p, x)
                for p, f, x in zip(params, fast_grads, exit_grads, strict=True)
                if f is not x and f is not NEVER
            ],
            handed=[None] * len(outs),
        )
        counters = [
            (k, compat.step_storage_counter(o))
            for k, o in enumerate(outs)
            if isinstance(o, torch.Tensor)
        ]
        rec.out_watch = [(k, count, count()) for k, count in counters]
        if self._recordings and not again:
            self._rerecords.append(str(self._last_mismatch or "a new guard set"))
        self._recordings.append(rec)
        self._made += 1
        self._last = rec
        self._pending = None
        self._entry(
            "recorded", f"recording {len(self._recordings)}: {self._guard_summary(current)}"
        )
        log.debug("capture_step %s: recorded (%d)", self._name, len(self._recordings))
        rec.clone_outputs = self._clone_outputs
        rec.single_output = len(outs) == 1 and out_single
        result = self._replay(rec, leaves, rec.exit_pairs)
        rec.fast = self._fast_check(rec, args, kwargs, leaves)
        host = [type(o).__name__ for o in outs if o is not None and not isinstance(o, torch.Tensor)]
        after = probe.read(leaves, tree)
        changed = current.mismatch(after, ignore_grads=True)
        if host:
            self._refuse(
                StepUnsupported(
                    StepRefusalKind.HOST_OUTPUT,
                    call_site(self.fn, "return"),
                    f"the step returns Python values ({', '.join(host)}), which a replay "
                    "would repeat unchanged",
                    "return tensors only",
                )
            )
        elif changed is not None:
            self._refuse(_python_state(self.fn, changed))
        return result  # type: ignore[no-any-return]

    def _fast_check(
        self, rec: _Recording, args: Sequence[Any], kwargs: Any, leaves: Sequence[Any]
    ) -> FastCheck | None:
        """The per-call check of ``rec`` from this call (whose full guard held), when its
        arguments are flat (positional and keyword arguments, no containers)."""
        flat = (*args, *kwargs.values())
        if len(leaves) != len(flat) or any(a is not v for a, v in zip(flat, leaves, strict=True)):
            return None
        return rec.probe.fast_check(flat, rec.fast_grads, tuple(kwargs))

    def _budget_spent(self, current: StepGuard) -> None:
        self._budget_skips += 1
        self._pending = current
        if self._budget_skips > 1:
            return
        limit = self.options.capture_step_max_recordings
        reason = StepUnsupported(
            StepRefusalKind.RECORDING_BUDGET,
            call_site(self.fn, ""),
            f"{len(self._recordings)} recordings and {self._extra_warm} calls for new guard sets "
            f"made (capture_step_max_recordings={limit}) and the guard failed again "
            f"({self._last_mismatch}); new guard sets run uncaptured",
            "keep shapes, parameters and float hyperparameters fixed (use a tensor lr), "
            "or raise capture_step_max_recordings",
        )
        self._report(reason, permanent=False)

    # --- refusals and the report ---------------------------------------------------------------

    def _refuse(self, reason: StepUnsupported) -> None:
        """From now on the step runs uncaptured (raises under ``cudagraph_or_error``)."""
        self._refusal = reason
        self._last = None
        self._recordings.clear()
        self._report(reason, permanent=True)

    def _report(self, reason: StepUnsupported, permanent: bool) -> None:
        self._entry(
            "refused" if permanent else "budget",
            str(reason),
            kind_=reason.kind.value,
            where=reason.where,
        )
        if reason.cuda_work:
            log.warning("capture_step %s runs uncaptured: %s", self._name, reason)
        else:
            log.info("capture_step %s runs uncaptured: %s", self._name, reason)
        if self.options.cudagraph_or_error and reason.cuda_work:
            raise CaptureStepError(reason, self._name)

    def _entry(self, kind: str, message: str, **data: Any) -> None:
        if self._record is None:
            self._record = new_record(f"capture_step {self._name}", (), self.options.as_dict())
        self._record.add_entry("capture_step", kind, message, **data)

    def _guard_summary(self, guard: StepGuard) -> str:
        tensors = [str(a) for a in guard.args if not isinstance(a, tuple)]
        t = self._targets
        found = [n for n, _ in (*t.modules, *t.optimizers, *t.scalers, *t.tensors)] if t else []
        # NOTE: what the step uses but the search missed is not guarded; say what was found.
        guarding = ", ".join(found) or "no module or optimizer found (pass track=[...])"
        return (
            f"arguments [{', '.join(tensors)}]; guarding {guarding}: {len(guard.objects)} "
            f"objects, {len(guard.pointers)} tensors, {len(guard.hyper)} hyperparameters"
        )

    def stats(self) -> StepStats:
        """How the step ran so far."""
        return StepStats(
            name=self._name,
            warmup_calls=self._warm,
            recordings=self._made,
            replays=self._replays,
            uncaptured_calls=self._uncaptured,
            refusal=self._refusal,
            rerecords=tuple(self._rerecords),
            budget_skips=self._budget_skips,
        )


def _python_state(fn: Callable[..., Any], changed: GuardMismatch) -> StepUnsupported:
    return StepUnsupported(
        StepRefusalKind.PYTHON_STATE,
        call_site(fn, ""),
        f"the step itself changes Python state that a replay would not change ({changed})",
        "keep scheduler.step(), parameter swaps and other Python updates out of the step "
        "(or use a tensor lr, which a replay reads)",
    )


@contextlib.contextmanager
def _watch_syncs(found: list[StepUnsupported]) -> Iterator[None]:
    """Each host synchronization the block makes becomes a refusal (with the
    user's source line), through CUDA's sync debug mode set to warn."""
    previous = torch.cuda.get_sync_debug_mode()
    with collect_syncs(found):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def capture_step(
    fn: Callable[P, R], /, *, track: Iterable[Any] = (), **options: Any
) -> CapturedStep[P, R]:
    """Capture a whole training step as one CUDA graph and replay it per call.

    ``fn`` does forward, loss, ``backward()``, ``optimizer.step()`` and
    ``zero_grad()``; its model may be compiled with ``backend="loom"`` or not.
    The modules, optimizers and tensors it uses are found from its closure and
    globals (``track=`` adds more). ``options`` are loom options
    (``capture_step_warmup``, ``capture_step_max_recordings``,
    ``cudagraph_or_error``), over ``TORCHLOOM_*`` environment variables.

    >>> opt = torch.optim.AdamW(model.parameters(), capturable=True)  # doctest: +SKIP
    >>> def train_step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> step = torchloom.capture_step(train_step)
    >>> for x, y in batches:
    ...     loss = step(x, y)          # warm-up, capture, then replays
    >>> print(step.stats().format())
    """
    if not callable(fn):
        raise TypeError(f"capture_step needs a callable step function, got {type(fn).__name__}")
    resolved = resolve_options(options=options)
    for name in ("capture_step_warmup", "capture_step_max_recordings"):
        if getattr(resolved, name) < 1:
            raise LoomOptionsError(
                f"loom option {name!r} must be at least 1, got {getattr(resolved, name)}"
            )
    return CapturedStep(fn, resolved, tuple(track))
