"""Process-wide entry points: :func:`reset`."""

from __future__ import annotations

from torchloom import _torch_compat as compat
from torchloom._report import reset_records

__all__ = ["reset"]


def reset() -> None:
    """Forget every compiled graph: torchloom's records and Dynamo's caches."""
    reset_records()
    compat.dynamo_reset()
