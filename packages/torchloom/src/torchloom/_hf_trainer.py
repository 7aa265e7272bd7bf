"""The Hugging Face ``Trainer``'s training step through ``capture_step``.

``Trainer.training_step(model, inputs, num_items_in_batch)`` is the forward, the loss
and ``accelerator.backward``: :class:`HFCaptureStep` (a mixin for any ``Trainer``
subclass) runs it as one captured step, the inputs and ``num_items_in_batch`` as its
arguments. Gradient clipping, ``optimizer.step()``, the scheduler and
``model.zero_grad()`` stay where the Trainer runs them, eagerly, between calls: the
Trainer's schedulers set a float learning rate on every step, which a captured
optimizer would have to record again each time. ``model.zero_grad()`` leaves the
gradients ``None``, so every call matches one recording; the micro-steps of a
gradient accumulation that add to them are a second. What the step reads from the
Trainer and may change (the accumulation divisor, DDP's gradient-sync flag) is an
argument, so the guard sees it.

Refused (the fit goes on uncaptured): DeepSpeed (its engine owns backward and step:
``DISTRIBUTED``), ``torch_empty_cache_steps`` (frees
memory inside the step: ``PYTHON_STATE``); and what ``capture_step`` refuses (fp16's
``GradScaler``: ``GRAD_SCALER``, a host synchronization in the model: ``SYNC_OP``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import loom_cudagraph
import loom_step
from torchloom._capture_step import capture_step
from torchloom._trainer_step import Rebuild, split_batch

__all__ = ["HFCaptureStep", "capture_step_trainer_class"]


class HFCaptureStep:
    """Mixin that runs a Hugging Face ``Trainer``'s ``training_step`` through
    :func:`torchloom.capture_step`: ``class MyTrainer(HFCaptureStep, SFTTrainer)``.

    ``capture_step_options``: ``capture_step``'s keyword arguments; ``capturer``:
    ``loom_cudagraph.HostCapturer()`` runs the same path on the host, for tests.

    >>> trainer = torchloom.trainers.CaptureStepTrainer(  # doctest: +SKIP
    ...     model=model, args=TrainingArguments(..., bf16=True), train_dataset=data)
    >>> trainer.train()
    >>> print(trainer.capture_step_stats().format())
    """

    def __init__(
        self,
        *args: Any,
        capture_step_options: Mapping[str, Any] | None = None,
        capturer: loom_cudagraph.Capturer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._loom = _TrainingStep(self, dict(capture_step_options or {}), capturer)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        return self._loom(model, inputs, num_items_in_batch)

    def capture_step_stats(self) -> loom_step.StepStats | None:
        """How the captured step ran (``None`` before the first step)."""
        step = self._loom.step
        return None if step is None else step.stats()


class _TrainingStep:
    """One ``CapturedStep`` for the model the Trainer trains (a new one if it changes)."""

    def __init__(
        self, trainer: Any, options: dict[str, Any], capturer: loom_cudagraph.Capturer | None
    ) -> None:
        self.trainer = trainer
        self.options = options
        self.capturer = capturer
        self.model: Any = None
        self.step: loom_step.CapturedStep[..., Any] | None = None
        self._rebuild: Rebuild | None = None

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any) -> Any:
        if model is not self.model or self.step is None:
            self.model, self.step = model, self._new_step(model)
        args, kwargs, self._rebuild = split_batch(inputs)
        trainer = self.trainer
        flags = (
            getattr(trainer, "current_gradient_accumulation_steps", 1),
            getattr(model, "require_backward_grad_sync", True),
        )
        return self.step(flags, num_items_in_batch, *args, **kwargs)

    def _new_step(self, model: Any) -> loom_step.CapturedStep[..., Any]:
        trainer = self.trainer
        training_step = super(HFCaptureStep, trainer).training_step  # type: ignore[misc]

        def hf_training_step(flags: tuple[int, bool], n: Any, *args: Any, **kwargs: Any) -> Any:
            # NOTE: flags (the accumulation divisor, DDP's gradient sync) are read by the
            # Trainer's step from its own state; as an argument each is guarded by value.
            assert self._rebuild is not None
            return training_step(model, self._rebuild(args, kwargs), n)

        # NOTE: a refusal names the training_step it runs (call_site unwraps to it).
        hf_training_step.__qualname__ = f"{type(trainer).__qualname__}.training_step"
        hf_training_step.__wrapped__ = training_step.__func__  # type: ignore[attr-defined]
        scaler = getattr(trainer.accelerator, "scaler", None)
        step = capture_step(
            hf_training_step,
            track=[t for t in (model, trainer.model, scaler) if t is not None],
            capturer=self.capturer,
            **self.options,
        )
        reason = _refusal(trainer)
        if reason is not None:
            step.refuse(reason)
        return step


def _refusal(trainer: Any) -> loom_step.StepUnsupported | None:
    """A setting of this Trainer that a replay would not honour."""
    where = f"{type(trainer).__qualname__}.training_step"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return loom_step.StepUnsupported(
            loom_step.StepRefusalKind.DISTRIBUTED,
            where,
            "DeepSpeed's engine runs backward and the optimizer step with host-side bookkeeping",
            "train without DeepSpeed (DDP or FSDP2) to capture the step",
            op="deepspeed",
        )
    if getattr(trainer.args, "torch_empty_cache_steps", None):
        return loom_step.StepUnsupported(
            loom_step.StepRefusalKind.PYTHON_STATE,
            where,
            "torch_empty_cache_steps empties the device cache inside the step, which a "
            "replay would not do",
            "unset torch_empty_cache_steps",
            op="torch_empty_cache_steps",
        )
    return None


@functools.cache
def capture_step_trainer_class() -> type:
    """``HFCaptureStep`` over ``transformers.Trainer`` (made on first use: transformers
    stays optional)."""
    import transformers

    return type(
        "CaptureStepTrainer",
        (HFCaptureStep, transformers.Trainer),
        {"__module__": "torchloom.trainers", "__doc__": HFCaptureStep.__doc__},
    )
