"""Activation offload compiled into graphs.

Saved-tensor hook pairs that move a tensor to the host and back (``save_on_cpu``,
``.cpu()``, a copy into a pinned buffer, a stream-based pair) are recognised among
the placed hook graphs and lowered (:func:`lower_offload`) to two operators: a
device-to-host copy on a transfer stream into a pinned pool that lives across
steps, issued right after the tensor's last forward use, and a host-to-device
reload prefetched ahead of its first backward use within a byte and layer window.
"""

from __future__ import annotations

from loom_offload._lower import (
    OffloadOptions,
    OffloadPlan,
    OffloadSite,
    SiteDecision,
    layer_of,
    lower_offload,
)
from loom_offload._ops import ensure_inductor_lowerings, offload_op, reload_op
from loom_offload._pool import HostPool, PoolStats
from loom_offload._recognize import why_not_offload_pack, why_not_offload_unpack
from loom_offload._runtime import (
    OffloadUnderCapture,
    Transfers,
    TransferStats,
    pool_stats,
    release_pools,
    transfers_for,
)

__version__ = "0.1.0"

__all__ = [
    "HostPool",
    "OffloadOptions",
    "OffloadPlan",
    "OffloadSite",
    "OffloadUnderCapture",
    "PoolStats",
    "SiteDecision",
    "TransferStats",
    "Transfers",
    "__version__",
    "ensure_inductor_lowerings",
    "layer_of",
    "lower_offload",
    "offload_op",
    "pool_stats",
    "release_pools",
    "reload_op",
    "transfers_for",
    "why_not_offload_pack",
    "why_not_offload_unpack",
]
