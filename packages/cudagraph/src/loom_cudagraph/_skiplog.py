"""Every skip is logged once, counted, and raised under ``or_error``.

Planning skips (an uncaptured segment with CUDA work) and runtime skips (a
budget exhausted, a capture that failed) both go through :func:`report_skip`,
so no path drops a graph from capture silently. Counters are per process and
read with :func:`skip_counts`.
"""

from __future__ import annotations

import collections
import logging
import threading

from loom_cudagraph._options import CudagraphOptions
from loom_cudagraph._plan import PartitionPlan
from loom_cudagraph._reasons import CudagraphError, CudagraphRefusalKind, Unsupported

__all__ = ["report_plan_skips", "report_skip", "reset_skip_counts", "skip_counts"]

log = logging.getLogger("torchloom.cudagraph")

_lock = threading.Lock()
_counts: collections.Counter[CudagraphRefusalKind] = collections.Counter()
_logged: set[tuple[str, Unsupported]] = set()


def report_skip(reason: Unsupported, graph: str, options: CudagraphOptions) -> None:
    """Log ``reason`` once for ``graph``, count it, and raise under ``or_error``.

    Uncaptured work that never touches CUDA (host-only arithmetic) is logged
    at debug level and neither counted nor raised: it leaves no device work
    outside a graph.
    """
    if not reason.cuda_work:
        log.debug("cudagraph: %s runs on the host only: %s", graph, reason)
        return
    with _lock:
        _counts[reason.kind] += 1
        first = (graph, reason) not in _logged
        _logged.add((graph, reason))
    if options.or_error:
        raise CudagraphError(reason, graph)
    if first:
        log.warning("cudagraph: %s: running uncaptured: %s", graph, reason)


def report_plan_skips(plan: PartitionPlan) -> None:
    """:func:`report_skip` for every reason of every uncaptured segment of ``plan``."""
    for seg in plan.segments:
        if seg.captured:
            continue
        for reason in seg.reasons:
            report_skip(reason, f"{plan.graph}/{seg.name}", plan.options)


def skip_counts() -> dict[CudagraphRefusalKind, int]:
    """How many skips of each kind this process counted since the last reset."""
    with _lock:
        return dict(_counts)


def reset_skip_counts() -> None:
    with _lock:
        _counts.clear()
        _logged.clear()
