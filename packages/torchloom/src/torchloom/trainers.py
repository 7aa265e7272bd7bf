"""The trainers people use, with a whole-step CUDA graph: ``capture_step`` in one line.

- PyTorch Lightning: ``Trainer(callbacks=[lightning_capture_step()])`` runs each
  automatic-optimization step (forward, backward, clipping, optimizer step) as one
  captured step; ``self.log`` in ``training_step`` keeps working.
- Hugging Face: ``CaptureStepTrainer(...)`` (or ``HFCaptureStep`` mixed into any
  ``Trainer`` subclass) runs ``training_step`` (forward and backward) as one.

Lightning and transformers are imported on first use, never by ``import torchloom``:
neither is a dependency of torchloom. What a trainer's step does that a replay would
not repeat is refused (``torchloom.StepRefusalKind``, with a hint) and that fit goes on
uncaptured. See docs/trainers.md.

>>> trainer = L.Trainer(callbacks=[torchloom.trainers.lightning_capture_step()])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchloom._hf_trainer import HFCaptureStep
    from torchloom._lightning import IN_STEP_HOOKS, lightning_capture_step

    CaptureStepTrainer: type

_LAZY = {
    "HFCaptureStep": "torchloom._hf_trainer",
    "IN_STEP_HOOKS": "torchloom._lightning",
    "lightning_capture_step": "torchloom._lightning",
}


# NOTE: type checkers see only the names above, so an unknown name imported from this
# module is an error there, not an ``Any``.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name == "CaptureStepTrainer":  # a transformers.Trainer subclass: made on first use
            value: Any = importlib.import_module(
                "torchloom._hf_trainer"
            ).capture_step_trainer_class()
        elif name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__all__ = ["IN_STEP_HOOKS", "CaptureStepTrainer", "HFCaptureStep", "lightning_capture_step"]
