"""Where a captured step is in its life, what it counted, and what it tells its listener.

A :class:`~loom_step.CapturedStep` moves through :class:`StepState` one way:
``NEW`` (not called yet) to ``WARMING_UP`` (eager calls before the first
recording) to ``CAPTURED`` (recordings replay; a new guard set warms up and
records again within the budget), and from any of them to ``UNCAPTURED`` (a
refusal: every call runs the step as written). Its counts live in one
:class:`StepCounters`; :class:`StepStats` is their frozen snapshot.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Literal

from loom_step._refusals import StepUnsupported

__all__ = ["StepCounters", "StepEvent", "StepListener", "StepState", "StepStats"]


class StepState(enum.Enum):
    """The state of a captured step (``step.stats().state``)."""

    #: Not called yet: its modules and optimizers are found on the first call.
    NEW = "new"
    #: Eager calls on the capture's side stream before the first recording.
    WARMING_UP = "warming_up"
    #: At least one recording replays.
    CAPTURED = "captured"
    #: Refused for good: every call runs the step as written.
    UNCAPTURED = "uncaptured"


@dataclasses.dataclass(slots=True)
class StepCounters:
    """What a captured step counted so far (mutable; :class:`StepStats` copies it)."""

    #: eager calls before a capture (the warm-up, and one per new guard set)
    warmup_calls: int = 0
    #: eager calls made for new guard sets after the warm-up (spend the budget)
    extra_warmups: int = 0
    recordings: int = 0
    replays: int = 0
    uncaptured_calls: int = 0
    #: calls that went past the per-call check (the full guard, warm-ups, captures)
    slow_calls: int = 0
    #: calls of new guard sets that ran uncaptured because the recording budget was spent
    budget_skips: int = 0
    #: calls whose decision the ranks agreed on (one all_reduce each)
    agreed_calls: int = 0
    #: agreed calls that did not do what this rank proposed (another rank's decision)
    overruled_calls: int = 0
    #: bytes the allocator reserved for the recordings' graph pools
    pool_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """How a captured step ran so far (``step.stats()``)."""

    name: str
    state: StepState
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
    #: Calls that went past the per-call check.
    slow_calls: int = 0
    #: Calls whose decision the ranks agreed on, and of those, the calls decided by
    #: another rank's proposal (this rank ran eagerly, or recorded, instead).
    agreed_calls: int = 0
    overruled_calls: int = 0
    #: Bytes the allocator reserved for the recordings' graph pools (the memory a
    #: replay's intermediate tensors live in, beside the step's own state).
    pool_bytes: int = 0

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
        if self.pool_bytes:
            lines.append(f"  graph pool: {self.pool_bytes / 2**20:.1f} MiB reserved")
        if self.agreed_calls:
            lines.append(
                f"  ranks: {self.agreed_calls} calls agreed, {self.overruled_calls} decided "
                "by another rank"
            )
        lines += [f"  re-recorded: {r}" for r in self.rerecords]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class StepEvent:
    """A recording made, a refusal for good, or a spent budget, as the step's listener
    (the umbrella's report) is told it."""

    kind: Literal["recorded", "refused", "budget"]
    message: str
    refusal: StepUnsupported | None = None


#: Told about each :class:`StepEvent` of a step.
StepListener = Callable[[StepEvent], None]
