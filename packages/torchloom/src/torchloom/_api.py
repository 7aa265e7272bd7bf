"""Process-wide entry points: :func:`reset`."""

from __future__ import annotations

from torchloom import _torch_compat as compat
from torchloom._cudagraph import release_runtimes
from torchloom._report import reset_records

__all__ = ["reset"]


def reset() -> None:
    """Forget every compiled graph: torchloom's records, its CUDA-graph runtimes
    (captured graphs and memory pools) and Dynamo's caches."""
    reset_records()
    release_runtimes()
    compat.dynamo_reset()
