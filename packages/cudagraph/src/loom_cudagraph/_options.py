"""Options of loom's CUDA-graph planner and runtime, as one frozen value."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["OR_ERROR_ENV", "CudagraphOptions"]

#: Setting this environment variable to ``1`` turns on ``or_error`` everywhere.
OR_ERROR_ENV = "TORCHLOOM_CUDAGRAPH_OR_ERROR"


@dataclasses.dataclass(frozen=True, slots=True)
class CudagraphOptions:
    """How loom captures: thresholds, budgets and the strict mode.

    >>> CudagraphOptions(or_error=True, max_recording=3).max_recording
    3
    """

    #: Raise :class:`CudagraphError` for any CUDA work left uncaptured.
    or_error: bool = False
    #: Recordings per segment and input shape (a new one per static-address set).
    max_recording: int = 5
    #: Segments with fewer work nodes run uncaptured (capture would not pay).
    min_segment_nodes: int = 1
    #: Distinct input shapes recorded per segment before it runs uncaptured.
    max_shapes: int = 8
    #: Capture functional collectives of NCCL process groups (with their waits) inside
    #: the graphs; ``False`` leaves every collective uncaptured (kind ``COLLECTIVE``).
    capture_collectives: bool = True

    def __post_init__(self) -> None:
        for name in ("max_recording", "min_segment_nodes", "max_shapes"):
            if getattr(self, name) < 0:
                raise ValueError(f"CudagraphOptions.{name} must be >= 0, got {getattr(self, name)}")

    def with_env(self, env: Mapping[str, str] | None = None) -> CudagraphOptions:
        """These options with ``TORCHLOOM_CUDAGRAPH_OR_ERROR=1`` applied."""
        env = os.environ if env is None else env
        if env.get(OR_ERROR_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            return dataclasses.replace(self, or_error=True)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CudagraphOptions:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
