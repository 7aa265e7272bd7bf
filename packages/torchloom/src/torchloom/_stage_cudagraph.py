"""The CUDA-graph stage: every capturable part of every graph runs as a CUDA graph.

With ``cudagraphs`` on (``mode="reduce-overhead"``), each aten graph is planned
by ``loom_cudagraph`` (capturable segments and typed reasons for the rest),
each segment is compiled by the pipeline's code generator, and capturable
segments are wrapped in loom's capture/replay runtime. The forward and
backward of one Dynamo graph share a memory pool. Every segment and every skip
is an entry of ``torchloom.report()`` under the area ``"cudagraph"``; with
``cudagraph_or_error`` (or ``TORCHLOOM_CUDAGRAPH_OR_ERROR=1``) a skip raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

import loom_cudagraph
from torchloom import _torch_compat as compat
from torchloom._errors import LoomRefusal
from torchloom._stages import Codegen, GraphContext, GraphKind, PipelineStage

__all__ = ["CudagraphStage", "cudagraph_stats"]

log = logging.getLogger("torchloom.cudagraph")

_runtimes: list[loom_cudagraph.CudagraphRuntime] = []


def cudagraph_stats() -> list[loom_cudagraph.RuntimeStats]:
    """Each CUDA-graph runtime built since start-up, as it ran so far."""
    return [r.stats() for r in _runtimes]


def _options(ctx: GraphContext) -> loom_cudagraph.CudagraphOptions:
    o = ctx.options
    return loom_cudagraph.CudagraphOptions(
        or_error=o.cudagraph_or_error,
        max_recording=o.cudagraph_max_recording,
        min_segment_nodes=o.cudagraph_min_segment_nodes,
        max_shapes=o.cudagraph_max_shapes,
    ).with_env()


def _runtime_from_code(code: compat.SegmentedOutputCode) -> Callable[[list[Any]], Any]:
    """Rebuild the runtime of a cached graph: same plan, same skips reported."""
    from torchloom._stages import STAGES

    plan = loom_cudagraph.PartitionPlan.from_json(code.plan_json)
    stage = next((s for s in STAGES if isinstance(s, CudagraphStage)), None)
    capturer = stage.capturer if stage is not None else None
    pool = code.pool or loom_cudagraph.new_pool(plan.device, capturer)
    runtime = loom_cudagraph.assemble_runtime(
        plan, code.segments, output_constants=code.output_constants, pool=pool, capturer=capturer
    )
    _runtimes.append(runtime)
    return runtime


def _cudagraph_error(exc: BaseException) -> loom_cudagraph.CudagraphError | None:
    """The ``CudagraphError`` somewhere in ``exc``'s cause chain, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, loom_cudagraph.CudagraphError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _listener(ctx: GraphContext) -> Callable[[loom_cudagraph.SegmentStats, str], None]:
    """Runtime events (recordings, budget skips) become report entries of the graph."""

    def listen(stats: loom_cudagraph.SegmentStats, event: str) -> None:
        kind = "recording" if event == "recorded" else "runtime-skip"
        detail = "" if event == "recorded" else f": {event}"
        ctx.record.add_entry(
            "cudagraph",
            kind,
            f"{stats.name}: {stats.recordings} recordings, {stats.shapes} shapes, "
            f"{stats.pool_bytes} pool bytes{detail}",
            segment=stats.name,
            recordings=stats.recordings,
            pool_bytes=stats.pool_bytes,
        )

    return listen


class CudagraphStage(PipelineStage):
    """Splits graphs into CUDA-graph segments and runs them through loom's runtime.

    ``capturer`` and ``device`` exist for tests: a ``HostCapturer`` on ``cpu``
    exercises the whole stage without a GPU.
    """

    name = "cudagraph"

    def __init__(
        self, capturer: loom_cudagraph.Capturer | None = None, device: str | None = None
    ) -> None:
        self.capturer = capturer
        self.device = device

    def wrap_backend(
        self,
        ctx: GraphContext,
        example_inputs: Sequence[Any],
        compile_cold: Callable[[], Callable[..., Any]],
    ) -> Callable[..., Any]:
        # ``cudagraph_or_error`` is a request to fail, not to fall back to eager.
        try:
            return compile_cold()
        except LoomRefusal as refusal:
            error = _cudagraph_error(refusal)
            if error is not None:
                raise error from None
            raise

    def compile(
        self,
        ctx: GraphContext,
        gm: GraphModule,
        kind: GraphKind,
        example_inputs: Sequence[Any],
        static_input_idxs: Sequence[int],
        codegen: Codegen,
    ) -> Callable[..., Any] | None:
        if not ctx.options.cudagraphs:
            return None
        options = _options(ctx)
        # NOTE: a backward's "fixed" inputs are saved activations, not parameters;
        # the runtime finds parameters and loom-managed tensors itself.
        static = () if kind is GraphKind.BACKWARD else tuple(static_input_idxs)
        graph = f"graph {ctx.graph_id} {kind.value}"
        plan = loom_cudagraph.plan_graph(
            gm, example_inputs, static, options, name=graph, device=self.device
        )
        self._record_plan(ctx, plan)
        if plan.device is None:
            return None
        if self.capturer is None and not torch.cuda.is_available():
            ctx.record.add_entry("cudagraph", "disabled", f"{graph}: no CUDA device available")
            return None
        if not plan.captured_segments:
            # Nothing to capture: the graph compiles whole, but its skips are
            # still logged, counted and raised under or_error.
            loom_cudagraph.report_plan_skips(plan)
            return None
        state = ctx.state.setdefault(self.name, {})
        pool = state.get("pool")
        if pool is None:
            pool = loom_cudagraph.new_pool(plan.device, self.capturer)
            state["pool"] = pool
        loom_cudagraph.report_plan_skips(plan)
        eager = ctx.options.codegen == "eager"
        with compat.segment_codegen_strides(gm) as before_segment:

            def compile_segment(
                seg: GraphModule, inputs: list[Any], seg_static: tuple[int, ...]
            ) -> Callable[[list[Any]], Sequence[Any]]:
                before_segment(seg)
                if eager:  # an OutputCode, so the compiled graph can be cached
                    return compat.EagerOutputCode(seg)  # type: ignore[return-value]
                return codegen(seg, inputs, seg_static)

            fns = loom_cudagraph.compile_segments(plan, gm, compile_segment, example_inputs)
        outs = gm.graph.output_node().args[0]
        flat = outs if isinstance(outs, list | tuple) else (outs,)
        constants = tuple(None if isinstance(o, torch.fx.Node) else o for o in flat)
        runtime = loom_cudagraph.assemble_runtime(
            plan,
            fns,
            output_constants=constants,
            pool=pool,
            capturer=self.capturer,
            listener=_listener(ctx),
            report_skips=False,
        )
        code = compat.SegmentedOutputCode(
            plan.to_json(),
            list(fns),
            constants,
            _runtime_from_code,
            is_backward=kind is GraphKind.BACKWARD,
            is_inference=kind is GraphKind.INFERENCE,
            runtime=runtime,
            pool=pool,
        )
        code.output_strides = compat.graph_output_strides(gm)
        _runtimes.append(runtime)
        state.setdefault("runtimes", []).append(runtime)
        return code

    def _record_plan(self, ctx: GraphContext, plan: loom_cudagraph.PartitionPlan) -> None:
        for seg in plan.segments:
            state = "captured" if seg.captured else "uncaptured"
            reasons = "; ".join(str(r) for r in seg.reasons)
            message = f"{plan.graph} {seg.name}: {state}, {len(seg.nodes)} nodes"
            ctx.record.add_entry(
                "cudagraph",
                "segment",
                f"{message}: {reasons}" if reasons else message,
                graph=plan.graph,
                segment=seg.index,
                captured=seg.captured,
                nodes=len(seg.nodes),
                work_nodes=seg.work_nodes,
                reasons=tuple(r.kind.value for r in seg.reasons),
            )
        for reason in plan.skips():
            ctx.record.add_entry(
                "cudagraph", "skip", f"{plan.graph}: {reason}", kind_=reason.kind.value
            )
