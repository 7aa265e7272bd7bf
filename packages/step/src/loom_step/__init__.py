"""Whole training steps as one CUDA graph: ``capture_step(train_step)``.

Forward, loss, ``backward()``, ``optimizer.step()`` and ``zero_grad()`` are
warmed up eagerly, captured once through ``loom_cudagraph``'s capture core, and
replayed per call while a guard on everything the replay reads holds
(arguments, modes, modules, parameters, optimizer state, hyperparameters,
gradients). What cannot be captured is refused with the op and the user's
``file:line``. ``torchloom.capture_step`` is this, with loom's options and report.

>>> step = capture_step(train_step, options=StepOptions(warmup=2))  # doctest: +SKIP
>>> for x, y in batches:
...     loss = step(x, y)
>>> print(step.stats().format())
"""

from loom_step._guard import GuardKind, GuardMismatch
from loom_step._options import StepOptions
from loom_step._refusals import (
    AnyStepRefusalKind,
    CaptureStepError,
    StepRefusalKind,
    StepUnsupported,
)
from loom_step._state import StepCounters, StepEvent, StepListener, StepState, StepStats
from loom_step._step import CapturedStep, capture_step

__version__ = "0.1.0"

__all__ = [
    "AnyStepRefusalKind",
    "CaptureStepError",
    "CapturedStep",
    "GuardKind",
    "GuardMismatch",
    "StepCounters",
    "StepEvent",
    "StepListener",
    "StepOptions",
    "StepRefusalKind",
    "StepState",
    "StepStats",
    "StepUnsupported",
    "__version__",
    "capture_step",
]
