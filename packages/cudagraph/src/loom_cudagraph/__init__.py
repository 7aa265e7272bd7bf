"""The CUDA-graph partition plan (which nodes can be captured, and typed reasons for those that cannot), the capture/replay runtime (static inputs, re-recording budget, input mutation, output lifetime, memory pool, dynamic shapes) and `or_error` mode.

Two calls cover the pipeline::

    plan = plan_graph(gm, example_inputs, static_input_indices, CudagraphOptions())
    run = build_runtime(plan, gm, compile_segment, example_inputs, pool=new_pool())
    outputs = run(list(inputs))   # boxed: the list is cleared
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562): a graph compiled without CUDA graphs
# imports neither the planner nor the runtime.
if TYPE_CHECKING:
    from loom_cudagraph._capture import Capturer, CudaCapturer, HostCapturer
    from loom_cudagraph._classify import classify_node, source_location
    from loom_cudagraph._collectives import capturable_groups
    from loom_cudagraph._live import release_graphs
    from loom_cudagraph._options import OR_ERROR_ENV, CudagraphOptions
    from loom_cudagraph._plan import PartitionPlan, PlanError, SegmentPlan, plan_graph
    from loom_cudagraph._pool import MemoryPool
    from loom_cudagraph._reasons import CudagraphError, CudagraphRefusalKind, Unsupported
    from loom_cudagraph._registry import (
        OpRule,
        mark_non_capturable,
        registered_rules,
        unmark_non_capturable,
    )
    from loom_cudagraph._runtime import (
        CompileSegment,
        CudagraphRuntime,
        RuntimeStats,
        assemble_runtime,
        build_runtime,
        compile_segments,
        eager_segment_compiler,
        new_pool,
    )
    from loom_cudagraph._segment import SegmentStats, is_managed, suspended
    from loom_cudagraph._skiplog import report_plan_skips, reset_skip_counts, skip_counts
    from loom_cudagraph._split import SegmentModule, split_by_plan

_LAZY: dict[str, str] = {
    **dict.fromkeys(("Capturer", "CudaCapturer", "HostCapturer"), "loom_cudagraph._capture"),
    **dict.fromkeys(("classify_node", "source_location"), "loom_cudagraph._classify"),
    "capturable_groups": "loom_cudagraph._collectives",
    "release_graphs": "loom_cudagraph._live",
    **dict.fromkeys(("CudagraphOptions", "OR_ERROR_ENV"), "loom_cudagraph._options"),
    **dict.fromkeys(
        ("PartitionPlan", "PlanError", "SegmentPlan", "plan_graph"), "loom_cudagraph._plan"
    ),
    "MemoryPool": "loom_cudagraph._pool",
    **dict.fromkeys(
        ("CudagraphError", "CudagraphRefusalKind", "Unsupported"), "loom_cudagraph._reasons"
    ),
    **dict.fromkeys(
        ("OpRule", "mark_non_capturable", "registered_rules", "unmark_non_capturable"),
        "loom_cudagraph._registry",
    ),
    **dict.fromkeys(
        (
            "CompileSegment",
            "CudagraphRuntime",
            "RuntimeStats",
            "assemble_runtime",
            "build_runtime",
            "compile_segments",
            "eager_segment_compiler",
            "new_pool",
        ),
        "loom_cudagraph._runtime",
    ),
    **dict.fromkeys(("SegmentStats", "is_managed", "suspended"), "loom_cudagraph._segment"),
    **dict.fromkeys(
        ("report_plan_skips", "reset_skip_counts", "skip_counts"), "loom_cudagraph._skiplog"
    ),
    **dict.fromkeys(("SegmentModule", "split_by_plan"), "loom_cudagraph._split"),
}


# NOTE: type checkers see only the imports above, so an unknown name imported from
# this package is an error there, not an ``Any``.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "OR_ERROR_ENV",
    "Capturer",
    "CompileSegment",
    "CudaCapturer",
    "CudagraphError",
    "CudagraphOptions",
    "CudagraphRefusalKind",
    "CudagraphRuntime",
    "HostCapturer",
    "MemoryPool",
    "OpRule",
    "PartitionPlan",
    "PlanError",
    "RuntimeStats",
    "SegmentModule",
    "SegmentPlan",
    "SegmentStats",
    "Unsupported",
    "__version__",
    "assemble_runtime",
    "build_runtime",
    "capturable_groups",
    "classify_node",
    "compile_segments",
    "eager_segment_compiler",
    "is_managed",
    "mark_non_capturable",
    "new_pool",
    "plan_graph",
    "registered_rules",
    "release_graphs",
    "report_plan_skips",
    "reset_skip_counts",
    "skip_counts",
    "source_location",
    "split_by_plan",
    "suspended",
    "unmark_non_capturable",
]
