"""PyTorch Lightning's training step through ``capture_step``: one callback.

``Trainer(callbacks=[torchloom.trainers.lightning_capture_step()])`` runs each
automatic-optimization step (``training_step``, ``zero_grad``, ``backward``,
gradient clipping, ``optimizer.step``: Lightning's own code, hooks and precision
plugin) as one captured step. The callback routes the epoch loop's automatic
optimization through a ``CapturedStep`` whose function is Lightning's own step,
with the batch as its arguments; the Python that Lightning runs inside a step is
kept right around each replay (which runs none):

- ``self.log`` calls in ``training_step`` are recorded, their tensors returned by
  the step, and logged after every call (replayed or not) with those tensors;
- the optimization progress counters advance by one step's worth per call (what a
  step that ran Lightning's code advanced them by), however often that code ran;
- the accumulation decisions (step the optimizer or not, zero the gradients or not)
  are arguments of the step, so a replay never takes one for the other.

Refused (the fit goes on uncaptured): gradient accumulation (its micro-steps alternate
two guard sets), manual optimization (``training_step`` is the
whole step; capture a step function of your own with ``torchloom.capture_step``), a
hook that runs user code inside the step (``on_before_backward``,
``on_after_backward``, ``on_before_optimizer_step``, ``on_before_zero_grad`` on the
module or a callback) as ``PYTHON_STATE``; everything ``capture_step`` itself refuses
(``fp16-mixed``'s ``GradScaler``: ``GRAD_SCALER``; ``.item()`` for a log: ``SYNC_OP``;
a non-capturable optimizer, ...).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import loom_cudagraph
import loom_step
from torchloom._capture_step import capture_step
from torchloom._trainer_step import Rebuild, overridden_hooks, split_batch

__all__ = ["IN_STEP_HOOKS", "lightning_capture_step"]

log = logging.getLogger("torchloom.trainers")

#: Hooks Lightning calls inside a training step: user code there runs at warm-up and
#: capture only, never in a replay.
IN_STEP_HOOKS = (
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
)
#: Lightning's own packages (the pytorch-lightning and lightning distributions).
_LIGHTNING = ("pytorch_lightning", "lightning")

Logged = list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]


def lightning_capture_step(
    *, capturer: loom_cudagraph.Capturer | None = None, **options: Any
) -> Any:
    """A Lightning ``Callback`` that runs each training step through
    :func:`torchloom.capture_step` (``options``: its keyword arguments; ``capturer``:
    ``loom_cudagraph.HostCapturer()`` runs the same path on the host, for tests).

    >>> trainer = L.Trainer(precision="bf16-mixed",  # doctest: +SKIP
    ...                     callbacks=[torchloom.trainers.lightning_capture_step()])
    >>> trainer.fit(module, loader)  # optimizer: AdamW(..., capturable=True)
    >>> print(trainer.callbacks[0].stats().format())
    """
    return _callback_class(_callback_bases())(capturer, options)


def _callback_bases() -> tuple[type, ...]:
    """``Callback`` of each Lightning flavour imported (``lightning.pytorch``,
    ``pytorch_lightning``: distinct classes), else of the first one importable."""
    names = [n for n in ("lightning.pytorch", "pytorch_lightning") if n in sys.modules]
    if not names:
        for name in ("pytorch_lightning", "lightning.pytorch"):
            with contextlib.suppress(ModuleNotFoundError):
                importlib.import_module(name)
                names = [name]
                break
    if not names:
        raise ImportError(
            "lightning_capture_step needs PyTorch Lightning: pip install pytorch-lightning"
        )
    bases = [sys.modules[n].Callback for n in names]
    return tuple(dict.fromkeys(bases))


@functools.cache
def _callback_class(bases: tuple[type, ...]) -> type:
    return type("LightningCaptureStep", (_CaptureStep, *bases), {"__module__": __name__})


class _CaptureStep:
    """The callback's behaviour (its class adds Lightning's ``Callback`` bases)."""

    def __init__(self, capturer: loom_cudagraph.Capturer | None, options: Mapping[str, Any]):
        super().__init__()
        self.capturer = capturer
        self.options = dict(options)
        self.step: loom_step.CapturedStep[..., Any] | None = None
        self._loop: Any = None
        #: the epoch loop's own ``run`` (Lightning's whole automatic step)
        self._run_step: Callable[..., Any] | None = None
        #: what the step's Python reads at this call: optimizer, batch_idx, kwargs, rebuild
        self._call: tuple[Any, int, Mapping[str, Any], Rebuild] | None = None
        self._progress_delta: dict[str, Any] = {}
        self._log_calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def stats(self) -> loom_step.StepStats | None:
        """How the captured step ran (``None`` before the fit starts)."""
        return None if self.step is None else self.step.stats()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        module = pl_module
        self._loop, self._run_step = loop, loop.run

        def lightning_training_step(flags: tuple[bool, bool], *args: Any, **kwargs: Any) -> Any:
            # NOTE: flags (accumulate, zero the gradients) are read by Lightning from the
            # batch index; as an argument each decision is a guard set of its own.
            assert self._call is not None and self._run_step is not None
            optimizer, batch_idx, call_kwargs, rebuild = self._call
            step_kwargs = OrderedDict(call_kwargs)
            step_kwargs["batch"] = rebuild(args, kwargs)
            logged: Logged = []
            before = loop.optim_progress.state_dict()
            with _recording_logs(module, logged):
                out = self._run_step(optimizer, batch_idx, step_kwargs)
            self._progress_delta = _difference(loop.optim_progress.state_dict(), before)
            self._log_calls = [(name, a, k) for name, _, a, k in logged]
            return out, tuple(value for _, value, _, _ in logged)

        # NOTE: a refusal names the user's training_step (call_site unwraps to it).
        lightning_training_step.__qualname__ = f"{type(pl_module).__qualname__}.training_step"
        lightning_training_step.__wrapped__ = type(pl_module).training_step  # type: ignore[attr-defined]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        track = [pl_module, trainer.strategy.model, *trainer.optimizers]
        self.step = capture_step(
            lightning_training_step,
            track=[t for t in (*track, scaler) if t is not None],
            capturer=self.capturer,
            **self.options,
        )
        reason = _refusal(trainer, pl_module, self)
        if reason is not None:
            self.step.refuse(reason)
            return
        # NOTE: Lightning has no public seam around a whole automatic step: the epoch
        # loop calls automatic_optimization.run(optimizer, batch_idx, kwargs) per batch.
        # Its instance attribute routes that call here until teardown.
        loop.run = self._captured_run

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._loop is not None:
            vars(self._loop).pop("run", None)
            self._loop = None

    def _captured_run(self, optimizer: Any, batch_idx: int, kwargs: Mapping[str, Any]) -> Any:
        assert self.step is not None
        trainer = self._loop.trainer
        args, kw, rebuild = split_batch(kwargs["batch"])
        self._call = (optimizer, batch_idx, kwargs, rebuild)
        accumulate = trainer.fit_loop._should_accumulate()
        zero_grad = batch_idx % trainer.accumulate_grad_batches == 0
        progress = self._loop.optim_progress
        before = progress.state_dict()
        out, values = self.step((accumulate, zero_grad), *args, **kw)
        self._call = None
        # NOTE: Lightning's code ran once (a warm-up, a CUDA capture), not at all (a
        # replay) or twice (the host capturer's capture): the counters say one step.
        progress.load_state_dict(_sum(before, self._progress_delta))
        self._log(trainer.lightning_module, values)
        return out

    def _log(self, module: Any, values: tuple[Any, ...]) -> None:
        """The step's ``self.log`` calls, with this call's values, as ``training_step``'s."""
        if not self._log_calls:
            return
        before = module._current_fx_name
        module._current_fx_name = "training_step"
        try:
            for (name, args, kwargs), value in zip(self._log_calls, values, strict=True):
                module.log(name, value, *args, **kwargs)
        finally:
            module._current_fx_name = before


@contextlib.contextmanager
def _recording_logs(module: Any, into: Logged) -> Iterator[None]:
    """``module.log`` records its calls instead of logging (they are logged after the
    step, replayed or not, with the values the step returned)."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        into.append((name, value, args, kwargs))

    module.log = record
    try:
        yield
    finally:
        del module.log


def _difference(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """``after - before`` of two nested dicts of counters."""
    return {
        k: _difference(v, before[k]) if isinstance(v, Mapping) else v - before[k]
        for k, v in after.items()
        if isinstance(v, Mapping | int) and not isinstance(v, bool)
    }


def _sum(state: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (_sum(v, delta[k]) if isinstance(v, Mapping) else v + delta[k]) if k in delta else v
        for k, v in state.items()
    }


def _refusal(trainer: Any, module: Any, own: Any) -> loom_step.StepUnsupported | None:
    """A setting of this fit that a replay would not honour."""
    kind = loom_step.StepRefusalKind.PYTHON_STATE
    if not module.automatic_optimization:
        return loom_step.StepUnsupported(
            kind,
            f"{type(module).__qualname__}.training_step",
            "manual optimization: training_step is the whole step, and Lightning's "
            "optimizer wrappers advance its progress counters in Python",
            "capture a step function of your own with torchloom.capture_step, or use "
            "automatic optimization",
        )
    if trainer.accumulate_grad_batches > 1:
        # NOTE: its micro-steps alternate two guard sets (accumulate, then step), and
        # capture_step captures a new guard set after an eager call of the same one.
        return loom_step.StepUnsupported(
            kind,
            f"{type(module).__qualname__}.training_step",
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the micro-steps "
            "alternate between accumulating and stepping, which capture_step does not "
            "record in turn",
            "capture with accumulate_grad_batches=1 (a larger batch per step), or leave "
            "this fit uncaptured",
            op="accumulate_grad_batches",
        )
    objects = [module, *(cb for cb in trainer.callbacks if cb is not own)]
    found = overridden_hooks(objects, IN_STEP_HOOKS, _LIGHTNING)
    if found:
        where, name = found[0]
        also = f" (and {', '.join(n for _, n in found[1:])})" if len(found) > 1 else ""
        return loom_step.StepUnsupported(
            kind,
            where,
            f"a hook with user code runs inside the training step{also}; a replay would not run it",
            "do that work in on_train_batch_end (after the step), or leave the callback out "
            "of a captured fit",
            op=name,
        )
    return None
