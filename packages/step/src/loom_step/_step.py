"""Whole-step CUDA graphs: ``capture_step(train_step)``.

The step (forward, loss, ``backward()``, ``optimizer.step()``, ``zero_grad()``)
runs eagerly for ``warmup`` calls on a side stream, is then captured as one CUDA
graph in its own memory pool through the capture core
(``loom_cudagraph.Capturer``), and replayed per call. A recording replays only
while its :class:`~loom_step._guard.StepGuard` holds (arguments, modes, modules,
optimizers, gradients); a new guard set gets one eager call and a new recording,
up to ``max_recordings``; beyond that it runs uncaptured with one logged reason.
A stale graph is never replayed. What cannot be captured is refused at warm-up
(:mod:`loom_step._refusals`): the step then runs uncaptured, or raises under
``or_error``. The step's life is a :class:`~loom_step.StepState`.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import torch

import loom_cudagraph
from loom_cudagraph import CudagraphRefusalKind
from loom_step import _torch_compat as compat
from loom_step._distributed import (
    DDP_WARMUP,
    FSDP2_CAPTURE_HINT,
    FSDP2_WARMUP,
    Action,
    RankAgreement,
    ddp_modules,
    fsdp2_modules,
    fsdp2_refusal,
    fsdp2_streams,
    join_capturing,
    quiet_ddp_timers,
    rank_agreement,
    rehome_ddp_accumulators,
)
from loom_step._fast import FastCheck
from loom_step._guard import GuardMismatch, StepGuard, StepProbe
from loom_step._options import StepOptions
from loom_step._recording import (
    Recording,
    new_recording,
    protect_outputs,
    record_step,
    static_arguments,
)
from loom_step._refusals import (
    CaptureStepError,
    StepRefusalKind,
    StepUnsupported,
    autocast_refusal,
    call_site,
    capture_refusal,
    collect_syncs,
    optimizer_refusals,
    scaler_refusals,
)
from loom_step._state import (
    StepCounters,
    StepEvent,
    StepListener,
    StepState,
    StepStats,
)
from loom_step._targets import StepTargets, find_targets

__all__ = ["CapturedStep", "capture_step"]

log = logging.getLogger("torchloom.capture_step")

#: What ``_replay`` returns when it must not replay (a view of a held output would change).
_HELD: Any = object()

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(slots=True)
class _Decision:
    """What one call does (:class:`Action`), with what the slow path found for it."""

    action: Action
    #: the recording to replay (or to record again)
    rec: Recording | None = None
    #: replay with the full guard's gradient pairs (and refresh the per-call check)
    full: bool = False
    reason: StepUnsupported | None = None
    probe: StepProbe | None = None
    current: StepGuard | None = None
    #: a warm-up of a new guard set after the first recording (spends the budget)
    extra: bool = False


@dataclasses.dataclass(slots=True)
class _NewGuardSets:
    """What the slow path knows of guard sets not recorded yet."""

    #: the guard (gradients ignored) of the last eager call: what the next capture records
    pending: StepGuard | None = None
    #: whether the last warm-up call changed Python state the guard reads
    changed_last: bool = False
    #: the first host synchronization a warm-up made: the capture is still tried
    #: (code may skip it under capture), and fails naming this one
    sync: StepUnsupported | None = None
    #: why the last recording did not match this call's guard set
    mismatch: GuardMismatch | None = None


class CapturedStep(Generic[P, R]):
    """The callable :func:`capture_step` returns; call it as the step itself."""

    def __init__(
        self,
        fn: Callable[P, R],
        options: StepOptions | None = None,
        track: Sequence[Any] = (),
        capturer: loom_cudagraph.Capturer | None = None,
        listener: StepListener | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options or StepOptions()
        self.capturer: loom_cudagraph.Capturer = capturer or loom_cudagraph.CudaCapturer()
        self.listener = listener
        self.counts = StepCounters()
        self._track = tuple(track)
        self._name = getattr(fn, "__qualname__", repr(fn))
        self._state = StepState.NEW
        self._targets: StepTargets | None = None
        self._recordings: list[Recording] = []
        #: the recording the last replay used (its fast check is tried first); None once refused
        self._last: Recording | None = None
        self._refusal: StepUnsupported | None = None
        self._new = _NewGuardSets()
        self._rerecords: list[str] = []
        #: return copies of outputs (set once a view of an output was held)
        self._clone_outputs = False
        #: eager calls before the first capture (more under DDP and FSDP2)
        self._min_warmup = self.options.warmup
        #: the step's FSDP2 modules (``fully_shard``), with their names
        self._fsdps: list[tuple[str, torch.nn.Module]] = []
        #: the ranks agreeing on each call, when the step involves a process group
        self._agreement: RankAgreement | None = None
        #: a refusal the first call found before running anything (no CUDA, optimizers)
        self._static: StepUnsupported | None = None

    @property
    def state(self) -> StepState:
        return self._state

    # --- per call ----------------------------------------------------------------------------

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._state is StepState.NEW:
            self._start(compat.tree_flatten((args, kwargs))[0])
        if self._agreement is not None:
            return self._agreed_call(args, kwargs)
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
            self.counts.uncaptured_calls += 1
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
        self.counts.slow_calls += 1
        leaves, tree = compat.tree_flatten((args, kwargs))
        return self._slow(args, kwargs, leaves, tree)

    def _replay(
        self,
        rec: Recording,
        leaves: Sequence[Any],
        grads: list[tuple[torch.Tensor, torch.Tensor | None]],
    ) -> Any:
        """Replay ``rec`` for these arguments, then set each ``(p, g)`` of ``grads`` as
        ``p.grad = g``; ``_HELD`` when an output of the last replay is held through a
        view that the replay would overwrite."""
        for _, _, count, baseline in rec.out_watch:
            if count() != baseline:  # an output of the last replay is still referenced
                if not protect_outputs(rec):
                    return _HELD
                break
        fill = rec.fill
        if fill:
            if len(fill) == 1:
                fill[0].copy_(leaves[rec.arg_idx[0]])
            else:
                compat.foreach_copy_(fill, [leaves[i] for i in rec.arg_idx])
        rec.replay()
        for p, g in grads:
            p.grad = g
        self.counts.replays += 1
        if rec.single_output:
            if rec.clone_outputs:
                return rec.outs[0].clone()
            alias = rec.outs[0].detach()
            rec.handed[0] = weakref.ref(alias)
            return alias
        outs = list(rec.outs)
        handed = rec.handed
        for pos in rec.tensor_pos:
            if rec.clone_outputs:
                outs[pos] = outs[pos].clone()
            else:
                outs[pos] = alias = outs[pos].detach()
                handed[pos] = weakref.ref(alias)
        return compat.tree_unflatten(outs, rec.out_tree)

    # --- slow paths --------------------------------------------------------------------------

    def _start(self, leaves: Sequence[Any]) -> None:
        """The first call: the step's targets, what refuses it before any call, DDP's
        and FSDP2's warm-up, DDP's timers, and the ranks' agreement (on every rank, so
        any group it makes is made together)."""
        self._targets = find_targets(self.fn, self._track)
        self._state = StepState.WARMING_UP
        self._static = self._static_refusal(leaves)
        ddps = ddp_modules(self._targets)
        if ddps:
            rehome_ddp_accumulators(self._targets, self.capturer.warm_up)
            quiet_ddp_timers(ddps)
            self._min_warmup = max(self.options.warmup, DDP_WARMUP)
            log.debug(
                "capture_step %s: DDP (%s): %d warm-up calls",
                self._name,
                ", ".join(n for n, _ in ddps),
                self._min_warmup,
            )
        self._fsdps = fsdp2_modules(self._targets)
        if self._fsdps:
            self._min_warmup = max(self._min_warmup, FSDP2_WARMUP)
            log.debug(
                "capture_step %s: FSDP2 (%d sharded modules, root %s): %d warm-up calls",
                self._name,
                len(self._fsdps),
                self._fsdps[0][0],
                self._min_warmup,
            )
        self._agreement = rank_agreement(self._targets, self.options.agree_across_ranks)

    def _slow(self, args: Any, kwargs: Any, leaves: list[Any], tree: Any) -> R:
        """A call the per-call checks did not replay: the full guard of each recording,
        then a warm-up, a capture, or an uncaptured call."""
        return self._do(self._decide(leaves, tree), args, kwargs, leaves, tree)

    def _decide(self, leaves: list[Any], tree: Any) -> _Decision:
        """What a call past the per-call checks does (nothing is run; only the guard
        mismatch is kept, for the report)."""
        assert self._targets is not None
        if self._static is not None:
            return _Decision(Action.REFUSE, reason=self._static)
        for rec in self._recordings:
            if rec.guard.mismatch(rec.probe.read(leaves, tree)) is None:
                return _Decision(Action.REPLAY, rec=rec, full=True)
        probe = StepProbe(self._targets)
        current = probe.read(leaves, tree, named=True)
        reason = autocast_refusal(self.fn) or self._host_argument(leaves)
        if reason is None and self._fsdps:
            reason = fsdp2_refusal(self._fsdps, call_site(self.fn, ""))
        if reason is not None:
            return _Decision(Action.REFUSE, reason=reason)
        if self._recordings:
            last = self._recordings[-1]
            self._new.mismatch = last.guard.mismatch(last.probe.read(leaves, tree))
        elif self._new.pending is not None:
            self._new.mismatch = self._new.pending.mismatch(current, ignore_grads=True)
        return self._plan_next(probe, current)

    def _plan_next(self, probe: StepProbe, current: StepGuard) -> _Decision:
        """What a call of a guard set with no recording does: warm up, capture, or run
        uncaptured once the budget is spent."""
        warmup, budget = self._min_warmup, self.options.max_recordings
        recorded = len(self._recordings)
        decision = functools.partial(_Decision, probe=probe, current=current)
        if not recorded and self.counts.warmup_calls < warmup:
            return decision(Action.WARM_UP)
        if recorded < budget and any(
            r.guard.mismatch(current, ignore_grads=True) is None for r in self._recordings
        ):
            # Only the gradients differ (accumulation into existing ones, or a first
            # micro-step after zero_grad): nothing compiles anew, capture right away.
            return decision(Action.CAPTURE)
        # NOTE: a new guard set gets one eager call (it may compile) before its
        # capture; guard sets that change on every call (a float lr stepped by a
        # scheduler) spend the budget through these calls and never capture.
        pending = self._new.pending
        if pending is None or pending.mismatch(current, ignore_grads=True) is not None:
            if self.counts.extra_warmups >= budget or recorded >= budget:
                return decision(Action.EAGER)
            return decision(Action.WARM_UP, extra=self.counts.warmup_calls >= warmup)
        if recorded >= budget:
            return decision(Action.EAGER)
        return decision(Action.CAPTURE)

    def _do(self, d: _Decision, args: Any, kwargs: Any, leaves: list[Any], tree: Any) -> R:
        """Run one call as ``d`` decided."""
        if d.action is Action.REFUSE:
            assert d.reason is not None
            if self._refusal is None:
                self._static = None
                self._refuse(d.reason)
            return self._eager(args, kwargs)
        if d.action is Action.REPLAY:
            rec = d.rec
            assert rec is not None
            if d.full:
                rec.fast = self._fast_check(rec, args, kwargs, leaves)
            self._last = rec
            out = self._replay(rec, leaves, rec.exit_pairs if d.full else rec.grad_fix)
            if out is not _HELD:
                return out  # type: ignore[no-any-return]
            return self._record_again_cloning(rec, args, kwargs, leaves, tree)
        probe, current = d.probe, d.current
        assert probe is not None and current is not None
        if d.action is Action.WARM_UP:
            self.counts.extra_warmups += 1 if d.extra else 0
            return self._warm_up(args, kwargs, probe, current, leaves, tree)
        if d.action is Action.CAPTURE:
            if d.rec is not None:  # a view of its outputs is held: record it again
                return self._record_again_cloning(d.rec, args, kwargs, leaves, tree)
            return self._capture(args, kwargs, probe, current, leaves, tree)
        return self._over_budget(args, kwargs, current)

    # --- the ranks' agreement ----------------------------------------------------------------

    def _agreed_call(self, args: Any, kwargs: Any) -> R:
        """One call decided with the other ranks: each proposes its own decision, all do
        the most conservative (the minimum :class:`Action`)."""
        agreement = self._agreement
        assert agreement is not None
        leaves, tree = compat.tree_flatten((args, kwargs))
        local = self._propose(args, kwargs, leaves, tree)
        agreed = Action(agreement.agree(int(local.action)))
        self.counts.agreed_calls += 1
        if agreed is not local.action:
            self.counts.overruled_calls += 1
        if agreed is Action.REFUSE:
            # every rank refuses at this call: no decision is left to agree on
            reason = self._agreed_reason(agreement, local.reason, "refused")
            self._agreement = None
            return self._do(_Decision(Action.REFUSE, reason=reason), args, kwargs, leaves, tree)
        if agreed is local.action:
            return self._do(local, args, kwargs, leaves, tree)
        if agreed is Action.EAGER or (agreed is Action.WARM_UP and local.action is Action.REPLAY):
            return self._eager(args, kwargs)
        if agreed is Action.WARM_UP:  # this rank would have captured: warm up once more
            warm = dataclasses.replace(local, action=agreed, rec=None)
            return self._do(warm, args, kwargs, leaves, tree)
        # agreed CAPTURE, this rank would have replayed: record its guard set again too
        assert local.rec is not None
        self._recordings.remove(local.rec)
        self._last = None
        assert self._targets is not None
        probe = StepProbe(self._targets)
        current = probe.read(leaves, tree, named=True)
        self._new.mismatch = None
        self._rerecords.append("another rank recorded a new guard set at this call")
        return self._capture(args, kwargs, probe, current, leaves, tree, again=True)

    def _propose(self, args: Any, kwargs: Any, leaves: list[Any], tree: Any) -> _Decision:
        """This rank's own decision for a call (nothing run)."""
        if self._refusal is not None:
            return _Decision(Action.REFUSE, reason=self._refusal)
        flat = (*args, *kwargs.values()) if kwargs else args
        names = tuple(kwargs)
        last = self._last
        for rec in (last, *(r for r in self._recordings if r is not last)):
            check = rec.fast if rec is not None else None
            if rec is None or check is None or check.keywords != names:
                continue
            if check.matches(flat):
                if self._held(rec):
                    break
                return _Decision(Action.REPLAY, rec=rec)
        self.counts.slow_calls += 1
        decision = self._decide(leaves, tree)
        if decision.action is Action.REPLAY and decision.rec is not None:
            if self._held(decision.rec):
                assert self._targets is not None
                probe = StepProbe(self._targets)
                current = probe.read(leaves, tree, named=True)
                return _Decision(Action.CAPTURE, rec=decision.rec, probe=probe, current=current)
        return decision

    def _held(self, rec: Recording) -> bool:
        """Whether ``rec`` may not replay now (a view of its last outputs is held)."""
        for _, _, count, baseline in rec.out_watch:
            if count() != baseline:
                return not protect_outputs(rec)
        return False

    def _agreed_reason(
        self, agreement: RankAgreement, own: StepUnsupported | None, what: str
    ) -> StepUnsupported:
        """This rank's refusal, or the first refusing rank's as this rank's reason."""
        texts = agreement.gather(None if own is None else (own.kind.value, str(own)))
        if own is not None:
            return own
        rank, (kind, text) = next((r, t) for r, t in enumerate(texts) if t is not None)
        return StepUnsupported(
            _refusal_kind(kind),
            call_site(self.fn, ""),
            f"rank {rank} {what}, so every rank does: {text}",
            f"see rank {rank}'s reason; the ranks decide together so that their "
            "collectives stay in step",
        )

    def _record_again_cloning(
        self, rec: Recording, args: Any, kwargs: Any, leaves: list[Any], tree: Any
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
        self._new.mismatch = None
        self._rerecords.append("a view of an output was held across calls (outputs are copied now)")
        return self._capture(args, kwargs, probe, current, leaves, tree, again=True)

    def _ddps(self) -> list[tuple[str, torch.nn.Module]]:
        return ddp_modules(self._targets) if self._targets is not None else []

    def _eager(self, args: Any, kwargs: Any) -> R:
        self.counts.uncaptured_calls += 1
        return self.fn(*args, **kwargs)

    def _static_refusal(self, leaves: Sequence[Any]) -> StepUnsupported | None:
        """Refusals that need no call: no CUDA, optimizers, gradient scalers."""
        assert self._targets is not None
        targets = self._targets
        dev = self.capturer.device_type
        on_device = (
            any(isinstance(v, torch.Tensor) and v.device.type == dev for v in leaves)
            or any(p.device.type == dev for p in targets.params())
            or any(t.device.type == dev for _, t in targets.tensors)
        )
        if not self.capturer.available() or not on_device:
            why = (
                "no CUDA device is available"
                if not self.capturer.available()
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
            if isinstance(v, torch.Tensor) and v.device.type != self.capturer.device_type:
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
        self.counts.warmup_calls += 1
        syncs: list[StepUnsupported] = []
        # NOTE: every warm-up after the first (lazy initializations run there as
        # eagerly as ever) is told that a capture is running: code that branches on it
        # takes, and compiles, the capture's branch before the capture
        rehearse = (
            compat.rehearsing_capture()
            if self.counts.warmup_calls > 1
            else contextlib.nullcontext()
        )
        with collect_syncs(syncs), loom_cudagraph.suspended(), rehearse:
            out = self.capturer.warm_up(lambda: self.fn(*args, **kwargs))
        after = probe.read(leaves, tree, named=True)
        changed = before.mismatch(after, ignore_grads=True)
        new = self._new
        if self._min_warmup > self.options.warmup and self.counts.warmup_calls <= DDP_WARMUP:
            # DDP's timer reads and bucket rebuild: over before the capture (see _start)
            syncs = [s for s in syncs if not s.origin.startswith(_DDP_FILE)]
        if syncs and new.sync is None:
            # NOTE: not a refusal yet. Libraries skip their data-dependent checks
            # while a stream is capturing (transformers' masks test
            # torch.cuda.is_current_stream_capturing()), so the capture is tried;
            # a sync there fails it, and the refusal names this one.
            new.sync = syncs[0]
            log.debug("capture_step %s: a warm-up synchronized: %s", self._name, syncs[0])
        if changed is not None and new.changed_last:
            self._refuse(_python_state(self.fn, changed))
        new.changed_last = changed is not None
        new.pending = after
        return out

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
        static = static_arguments(leaves, tree)
        failed: StepUnsupported | None = None
        # FSDP2's side streams joined the capture through their waits on it: join them back.
        streams = fsdp2_streams(self._fsdps)
        finish = functools.partial(join_capturing, streams) if streams else None
        reserved = self.capturer.reserved()
        try:
            made = record_step(self.capturer, self.fn, probe, static, finish)
        except RuntimeError as exc:
            failed = self._new.sync or _capture_failed(
                self.fn, exc, bool(self._ddps()), bool(self._fsdps)
            )
        agreement = self._agreement
        if agreement is not None:
            # NOTE: no rank replays a recording another rank failed to make.
            if not agreement.agree(0 if failed else 1):
                failed = self._agreed_reason(agreement, failed, "failed to capture")
                self._agreement = None
        if failed is not None:
            self._refuse(failed)
            for _, module in self._fsdps:  # events recorded inside the failed capture
                compat.fsdp2_forget_events(module)
            return self._eager(args, kwargs)
        self.counts.pool_bytes += self.capturer.pool_bytes(reserved)
        rec = new_recording(self.capturer, current, probe, static, made, self._clone_outputs)
        del made
        self._add_recording(rec, current, again)
        result = self._replay(rec, leaves, rec.exit_pairs)
        rec.fast = self._fast_check(rec, args, kwargs, leaves)
        self._check_replay(rec, probe, current, leaves, tree)
        return result  # type: ignore[no-any-return]

    def _add_recording(self, rec: Recording, current: StepGuard, again: bool) -> None:
        if self._recordings and not again:
            self._rerecords.append(str(self._new.mismatch or "a new guard set"))
        self._recordings.append(rec)
        self.counts.recordings += 1
        self._last = rec
        self._state = StepState.CAPTURED
        self._new.pending = None
        self._emit(
            StepEvent(
                "recorded",
                f"recording {len(self._recordings)}: {self._guard_summary(current)}",
            )
        )
        log.debug("capture_step %s: recorded (%d)", self._name, len(self._recordings))

    def _check_replay(
        self, rec: Recording, probe: StepProbe, current: StepGuard, leaves: list[Any], tree: Any
    ) -> None:
        """After a recording's first replay: refuse a step that returns Python values or
        that changed Python state a later replay would not change."""
        host = [
            type(o).__name__ for o in rec.outs if o is not None and not isinstance(o, torch.Tensor)
        ]
        changed = current.mismatch(probe.read(leaves, tree), ignore_grads=True)
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

    def _fast_check(
        self, rec: Recording, args: Sequence[Any], kwargs: Any, leaves: Sequence[Any]
    ) -> FastCheck | None:
        """The per-call check of ``rec`` from this call (whose full guard held), when its
        arguments are flat (positional and keyword arguments, no containers)."""
        flat = (*args, *kwargs.values())
        if len(leaves) != len(flat) or any(a is not v for a, v in zip(flat, leaves, strict=True)):
            return None
        return rec.probe.fast_check(flat, rec.fast_grads, tuple(kwargs))

    def _over_budget(self, args: Any, kwargs: Any, current: StepGuard) -> R:
        """A new guard set past the recording budget runs uncaptured (reported once)."""
        self.counts.budget_skips += 1
        self._new.pending = current
        if self.counts.budget_skips == 1:
            limit = self.options.max_recordings
            reason = StepUnsupported(
                CudagraphRefusalKind.RECORDING_BUDGET,
                call_site(self.fn, ""),
                f"{len(self._recordings)} recordings and {self.counts.extra_warmups} calls for "
                f"new guard sets made (capture_step_max_recordings={limit}) and the guard failed "
                f"again ({self._new.mismatch}); new guard sets run uncaptured",
                "keep shapes, parameters and float hyperparameters fixed (use a tensor lr), "
                "or raise capture_step_max_recordings",
            )
            self._report(reason, permanent=False)
        return self._eager(args, kwargs)

    # --- refusals and the report ---------------------------------------------------------------

    def refuse(self, reason: StepUnsupported) -> None:
        """Run the step uncaptured from now on, for a reason found outside it (a trainer's
        setting that a replay would not honour), reported as every refusal is: logged,
        told to the listener, in :meth:`stats`, raised under ``or_error``. A step that is
        already uncaptured keeps its first reason."""
        if self._refusal is None:
            self._refuse(reason)

    def _refuse(self, reason: StepUnsupported) -> None:
        """From now on the step runs uncaptured (raises under ``or_error``)."""
        self._refusal = reason
        self._state = StepState.UNCAPTURED
        self._last = None
        self._recordings.clear()
        self._report(reason, permanent=True)

    def _report(self, reason: StepUnsupported, permanent: bool) -> None:
        self._emit(StepEvent("refused" if permanent else "budget", str(reason), reason))
        if reason.cuda_work:
            log.warning("capture_step %s runs uncaptured: %s", self._name, reason)
        else:
            log.info("capture_step %s runs uncaptured: %s", self._name, reason)
        if self.options.or_error and reason.cuda_work:
            raise CaptureStepError(reason, self._name)

    def _emit(self, event: StepEvent) -> None:
        if self.listener is not None:
            self.listener(event)

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
        c = self.counts
        return StepStats(
            name=self._name,
            state=self._state,
            warmup_calls=c.warmup_calls,
            recordings=c.recordings,
            replays=c.replays,
            uncaptured_calls=c.uncaptured_calls,
            refusal=self._refusal,
            rerecords=tuple(self._rerecords),
            budget_skips=c.budget_skips,
            slow_calls=c.slow_calls,
            agreed_calls=c.agreed_calls,
            overruled_calls=c.overruled_calls,
            pool_bytes=c.pool_bytes,
        )


def _python_state(fn: Callable[..., Any], changed: GuardMismatch) -> StepUnsupported:
    return StepUnsupported(
        StepRefusalKind.PYTHON_STATE,
        call_site(fn, ""),
        f"the step itself changes Python state that a replay would not change ({changed})",
        "keep scheduler.step(), parameter swaps and other Python updates out of the step "
        "(or use a tensor lr, which a replay reads)",
    )


#: Where DDP's own host synchronizations come from (``StepUnsupported.origin``).
_DDP_FILE = "torch/nn/parallel/distributed.py:"

#: What a DDP step's capture needs that capture_step cannot set itself.
DDP_CAPTURE_HINT = (
    "for DDP, PyTorch's whole-network capture recipe also needs "
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment before init_process_group; "
    "capture_step itself rebuilds DDP's reducer on a side stream (its grad accumulators "
    "keep the stream DDP was built on), warms DDP up for 11 iterations and sets its "
    "runtime-logging sample rate"
)


def _capture_failed(
    fn: Callable[..., Any], exc: RuntimeError, ddp: bool = False, fsdp2: bool = False
) -> StepUnsupported:
    """A failed capture, naming the user's line and the library frame that raised."""
    hints = [h for h, on in ((DDP_CAPTURE_HINT, ddp), (FSDP2_CAPTURE_HINT, fsdp2)) if on]
    hint = "; ".join(hints) or "run it with TORCHLOOM_LOG=debug and report the op"
    return capture_refusal(fn, exc, hint)


def _refusal_kind(value: str) -> StepRefusalKind | CudagraphRefusalKind:
    """A refusal kind from its value (sent from another rank)."""
    try:
        return StepRefusalKind(value)
    except ValueError:
        return CudagraphRefusalKind(value)


def capture_step(
    fn: Callable[P, R],
    /,
    *,
    track: Iterable[Any] = (),
    options: StepOptions | None = None,
    capturer: loom_cudagraph.Capturer | None = None,
    listener: StepListener | None = None,
) -> CapturedStep[P, R]:
    """Capture a whole training step as one CUDA graph and replay it per call.

    ``fn`` does forward, loss, ``backward()``, ``optimizer.step()`` and
    ``zero_grad()``; its model may be compiled with ``backend="loom"`` or not.
    The modules, optimizers and tensors it uses are found from its closure and
    globals (``track=`` adds more). ``capturer`` defaults to CUDA
    (``loom_cudagraph.HostCapturer()`` simulates it on the host); ``listener`` is
    told each recording and refusal (``torchloom.capture_step`` passes its report).

    >>> opt = torch.optim.AdamW(model.parameters(), capturable=True)  # doctest: +SKIP
    >>> def train_step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> step = loom_step.capture_step(train_step, options=loom_step.StepOptions(warmup=2))
    >>> for x, y in batches:
    ...     loss = step(x, y)          # warm-up, capture, then replays
    >>> print(step.stats().format())
    """
    if not callable(fn):
        raise TypeError(f"capture_step needs a callable step function, got {type(fn).__name__}")
    return CapturedStep(fn, options, tuple(track), capturer, listener)
