"""Options of whole-step capture, as one frozen value.

They are the step's alone: no compiled graph reads them, so they never enter a
backend cache key (the umbrella resolves them from ``capture_step_*`` keyword
arguments and ``TORCHLOOM_CAPTURE_STEP_*`` environment variables).
"""

from __future__ import annotations

import dataclasses

__all__ = ["StepOptions"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepOptions:
    """How a step is warmed up, how many recordings it may make, and the strict mode.

    >>> StepOptions(warmup=2).max_recordings
    4
    """

    #: Eager calls of the step (on a side stream) before its first capture.
    warmup: int = 3
    #: Recordings (one per guard set) before new guard sets run uncaptured.
    max_recordings: int = 4
    #: Raise :class:`~loom_step.CaptureStepError` when CUDA work would run uncaptured.
    or_error: bool = False
    #: Agree on each call's decision with the other ranks (one host all_reduce per
    #: call): ``None`` when the step uses a DDP or FSDP2 module and more than one rank
    #: runs, ``True`` over the default group whenever more than one rank runs,
    #: ``False`` never (every rank must then see the same guard sets on the same calls).
    agree_across_ranks: bool | None = None

    def __post_init__(self) -> None:
        for name in ("warmup", "max_recordings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepOptions.{name} must be an int >= 1, got {value!r}")
