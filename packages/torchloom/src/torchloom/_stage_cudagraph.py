"""The CUDA-graph stage: every capturable part of every graph runs as a CUDA graph.

With ``cudagraphs`` on (``mode="reduce-overhead"``), each aten graph is planned
by ``loom_cudagraph`` (capturable segments and typed reasons for the rest),
each segment is compiled by the pipeline's code generator, and capturable
segments are wrapped in loom's capture/replay runtime. The forward and
backward of one Dynamo graph share a memory pool. Every segment and every skip
is an entry of ``torchloom.report()`` under the area ``"cudagraph"``; with
``cudagraph_or_error`` (or ``TORCHLOOM_CUDAGRAPH_OR_ERROR=1``) a skip raises.

The stage is a :class:`~torchloom._stage_cache.CachedStage`: its effective
options and the op registry enter the cache key, every plan is stored as JSON,
and a hit re-makes the plans' report entries and skip messages from them while
each captured graph's runtime is reassembled from its stored segments (no AOT
tracing, no planning, no codegen).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
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
#: The graph being compiled, so that a runtime rebuilt from the cache joins it
#: (its pool, its report) as the cold compile's runtime did.
_compiling: contextvars.ContextVar[GraphContext | None] = contextvars.ContextVar(
    "torchloom_cudagraph_compiling", default=None
)


def cudagraph_stats() -> list[loom_cudagraph.RuntimeStats]:
    """Each CUDA-graph runtime built since start-up, as it ran so far."""
    return [r.stats() for r in _runtimes]


def _options(ctx: GraphContext) -> loom_cudagraph.CudagraphOptions:
    # NOTE: no ``with_env()``: TORCHLOOM_CUDAGRAPH_OR_ERROR is already resolved into
    # ctx.options, below mode= and options=; reading it again here would let it win.
    o = ctx.options
    return loom_cudagraph.CudagraphOptions(
        or_error=o.cudagraph_or_error,
        max_recording=o.cudagraph_max_recording,
        min_segment_nodes=o.cudagraph_min_segment_nodes,
        max_shapes=o.cudagraph_max_shapes,
    )


def _graph_name(ctx: GraphContext, kind: GraphKind) -> str:
    return f"graph {ctx.graph_id} {kind.value}"


def _pool(ctx: GraphContext, plan: loom_cudagraph.PartitionPlan, stage: CudagraphStage) -> Any:
    """The memory pool the forward and backward of one Dynamo graph share."""
    state = ctx.state.setdefault(CudagraphStage.name, {})
    if state.get("pool") is None:
        state["pool"] = loom_cudagraph.new_pool(plan.device, stage.capturer)
    return state["pool"]


def _runtime_from_code(code: compat.SegmentedOutputCode) -> Callable[[list[Any]], Any]:
    """Rebuild the runtime of a cached graph from its stored plan and segments.

    Inside a loom compilation (a cache hit) the runtime joins that graph as the
    cold one did: named after it, sharing its pool, reporting recordings to
    its record; the stage's ``replay_cached`` reports the plan's skips. Outside
    one, it reports the skips itself.
    """
    from torchloom._stages import STAGES

    plan = loom_cudagraph.PartitionPlan.from_json(code.plan_json)
    stage = next((s for s in STAGES if isinstance(s, CudagraphStage)), CudagraphStage())
    ctx = _compiling.get()
    pool, listener = code.pool, None
    if ctx is not None:
        kind = GraphKind.BACKWARD if code.is_backward else GraphKind.FORWARD
        kind = GraphKind.INFERENCE if code.is_inference else kind
        plan = dataclasses.replace(plan, graph=_graph_name(ctx, kind))
        pool, listener = _pool(ctx, plan, stage), _listener(ctx)
    runtime = loom_cudagraph.assemble_runtime(
        plan,
        code.segments,
        output_constants=code.output_constants,
        pool=pool or loom_cudagraph.new_pool(plan.device, stage.capturer),
        capturer=stage.capturer,
        listener=listener,
        report_skips=ctx is None,
    )
    if ctx is not None:
        ctx.state[CudagraphStage.name].setdefault("runtimes", []).append(runtime)
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
        token = _compiling.set(ctx)
        try:
            return compile_cold()
        except LoomRefusal as refusal:
            error = _cudagraph_error(refusal)
            if error is not None:
                raise error from None
            raise
        finally:
            _compiling.reset(token)

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
        graph = _graph_name(ctx, kind)
        plan = loom_cudagraph.plan_graph(
            gm, example_inputs, static, options, name=graph, device=self.device
        )
        plans = ctx.state.setdefault(self.name, {}).setdefault("plans", [])
        outcome = self._outcome(plan)
        plans.append({"kind": kind.value, "outcome": outcome, "plan": plan.to_json()})
        self._report_plan(ctx, plan, outcome)
        if outcome != "captured":
            # Nothing to capture: the graph compiles whole (its skips were
            # still logged, counted and raised under or_error).
            return None
        pool = _pool(ctx, plan, self)
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
        ctx.state[self.name].setdefault("runtimes", []).append(runtime)
        return code

    # --- the cache: settings in the key, plans stored, entries re-made on a hit ---

    def cache_settings(self, ctx: GraphContext) -> Mapping[str, Any] | None:
        """Everything beyond the options that decides the plans: the effective
        options (environment included), the op registry and the capturer."""
        if not ctx.options.cudagraphs:
            return None
        return {
            **_options(ctx).to_dict(),
            "rules": sorted(
                f"{r.name}: {r.kind.value}: {r.explanation} ({r.hint})"
                for r in loom_cudagraph.registered_rules()
            ),
            "capturer": type(self.capturer).__name__ if self.capturer else "cuda",
            "device": self.device,
        }

    def cache_payload(self, ctx: GraphContext) -> Any:
        """The plans of this graph, as JSON, with what became of each."""
        plans = ctx.state.get(self.name, {}).get("plans")
        return tuple(tuple(sorted(p.items())) for p in plans) if plans else None

    def replay_cached(self, ctx: GraphContext, payload: Any) -> None:
        """A hit: the cold compile's entries and skip messages, from its plans."""
        for item in payload:
            stored = dict(item)
            kind = GraphKind(stored["kind"])
            plan = loom_cudagraph.PartitionPlan.from_json(stored["plan"])
            plan = dataclasses.replace(plan, graph=_graph_name(ctx, kind))
            self._report_plan(ctx, plan, stored["outcome"])

    def _outcome(self, plan: loom_cudagraph.PartitionPlan) -> str:
        if plan.device is None:
            return "no-device"
        if self.capturer is None and not torch.cuda.is_available():
            return "disabled"
        return "captured" if plan.captured_segments else "uncaptured"

    def _report_plan(
        self, ctx: GraphContext, plan: loom_cudagraph.PartitionPlan, outcome: str
    ) -> None:
        """The plan's report entries, then (when it runs on a device) its skips
        logged, counted and raised under or_error."""
        self._record_plan(ctx, plan)
        if outcome == "disabled":
            ctx.record.add_entry("cudagraph", "disabled", f"{plan.graph}: no CUDA device available")
        elif outcome in ("captured", "uncaptured"):
            loom_cudagraph.report_plan_skips(plan)

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
