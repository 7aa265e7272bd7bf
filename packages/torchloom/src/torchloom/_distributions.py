"""The eight distributions torchloom is made of: what ``torchloom --version``
prints and what the cache key records (no torch import here: the command line
reads it at start-up)."""

from __future__ import annotations

from typing import Final

__all__ = ["LOOM_DISTRIBUTIONS"]

LOOM_DISTRIBUTIONS: Final = (
    "torchloom",
    "torchloom-cache",
    "torchloom-hops",
    "torchloom-tracer",
    "torchloom-resize",
    "torchloom-cudagraph",
    "torchloom-step",
    "torchloom-sidefx",
    "torchloom-cells",
)
