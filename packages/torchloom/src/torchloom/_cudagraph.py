"""The CUDA-graph codegen choice: every capturable part of every graph runs as a CUDA graph.

With ``cudagraphs`` on (``mode="reduce-overhead"``), :func:`compile_segmented`
plans each aten graph with ``loom_cudagraph`` (capturable segments and typed
reasons for the rest), compiles each segment with the pipeline's code
generator and wraps capturable segments in loom's capture/replay runtime. The
forward and backward of one Dynamo graph share a memory pool, held by the
graph's :class:`CudagraphSession`. Every segment and every skip is an entry of
``torchloom.report()`` under ``"cudagraph"``; with ``cudagraph_or_error`` a
skip raises.

For the cache, :func:`cudagraph_settings` (the effective options, the op
registry, the capturer) enters the key, every plan is stored as JSON, and a hit
re-makes the plans' report entries and skip messages from them
(:func:`replay_plans`) while each captured graph's runtime is reassembled from
its stored segments (no AOT tracing, no planning, no codegen).

Every runtime built is listed for :func:`cudagraph_stats` until
:func:`torchloom.reset` releases it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule

import loom_cudagraph
from torchloom import _torch_compat as compat
from torchloom._options import LoomOptions
from torchloom._output_code import EagerOutputCode, SegmentedOutputCode
from torchloom._report import GraphRecordBuilder
from torchloom._values import Codegen, GraphKind

__all__ = [
    "CudagraphSession",
    "PlanOutcome",
    "StoredPlan",
    "compile_segmented",
    "cudagraph_error",
    "cudagraph_options",
    "cudagraph_session",
    "cudagraph_settings",
    "cudagraph_stats",
    "plan_graph",
    "release_graphs",
    "release_runtimes",
    "replay_plans",
]

log = logging.getLogger("torchloom.cudagraph")

if TYPE_CHECKING:
    #: ``loom_cudagraph.plan_graph``'s signature (a test may pass another planner).
    PlanFn = Callable[..., loom_cudagraph.PartitionPlan]

_runtimes: list[loom_cudagraph.CudagraphRuntime] = []


def cudagraph_stats() -> list[loom_cudagraph.RuntimeStats]:
    """Each CUDA-graph runtime built since :func:`torchloom.reset` (or start-up), as
    it ran so far: per segment, recordings, replays, shapes and pool bytes.

    >>> torchloom.cudagraph_stats()[0].format()  # doctest: +SKIP
    """
    return [r.stats() for r in _runtimes]


def plan_graph(*args: Any, **kwargs: Any) -> loom_cudagraph.PartitionPlan:
    """:func:`loom_cudagraph.plan_graph`, the pipeline's planner: the planner is
    imported at the first graph compiled with CUDA graphs, not with the backend."""
    return loom_cudagraph.plan_graph(*args, **kwargs)


def release_graphs() -> None:
    """Drop the captured CUDA graphs of every runtime (see
    :func:`loom_cudagraph.release_graphs`): ``torch._dynamo.reset()`` calls it."""
    loom_cudagraph.release_graphs()


def release_runtimes() -> None:
    """Drop every CUDA-graph runtime's captured graphs and loom's references to the
    runtimes (their memory pools go back once the outputs they handed out are gone)."""
    loom_cudagraph.release_graphs()
    _runtimes.clear()


class PlanOutcome(enum.Enum):
    """What became of one aten graph's plan."""

    #: Some segment runs as a CUDA graph.
    CAPTURED = "captured"
    #: The plan runs on a device, but no segment is captured (its skips are reported).
    UNCAPTURED = "uncaptured"
    #: The graph works on no CUDA device: nothing to capture.
    NO_DEVICE = "no-device"
    #: No CUDA device is available (and no stand-in capturer): CUDA graphs are off.
    DISABLED = "disabled"


@dataclasses.dataclass(frozen=True, slots=True)
class StoredPlan:
    """One aten graph's plan as the cache stores it: its kind, what became of it
    and the plan's JSON."""

    kind: GraphKind
    outcome: PlanOutcome
    plan_json: str

    def to_payload(self) -> tuple[tuple[str, str], ...]:
        return (
            ("kind", self.kind.value),
            ("outcome", self.outcome.value),
            ("plan", self.plan_json),
        )

    @staticmethod
    def from_payload(item: Sequence[tuple[str, str]]) -> StoredPlan:
        stored = dict(item)
        return StoredPlan(GraphKind(stored["kind"]), PlanOutcome(stored["outcome"]), stored["plan"])


@dataclasses.dataclass
class CudagraphSession:
    """The CUDA-graph state of one Dynamo graph's compilation, mutable while it
    compiles: the memory pool its forward and backward share (made at the first
    captured plan), the plans made (for the cache). A runtime rebuilt from the cache
    finds it through :func:`cudagraph_session`.
    ``capturer`` and ``device`` come from the pipeline (a ``HostCapturer`` on ``cpu``
    exercises everything without a GPU)."""

    graph_id: int
    record: GraphRecordBuilder
    capturer: loom_cudagraph.Capturer | None = None
    device: str | None = None
    pool: Any = None
    plans: list[StoredPlan] = dataclasses.field(default_factory=list)

    def graph_name(self, kind: GraphKind) -> str:
        return f"graph {self.graph_id} {kind.value}"

    def pool_for(self, plan: loom_cudagraph.PartitionPlan) -> Any:
        if self.pool is None:
            self.pool = loom_cudagraph.new_pool(plan.device, self.capturer)
        return self.pool

    def payload(self) -> tuple[tuple[tuple[str, str], ...], ...] | None:
        return tuple(p.to_payload() for p in self.plans) or None


#: The graph being compiled, so that a runtime rebuilt from the cache joins it
#: (its pool, its report) as the cold compile's runtime did.
_session: contextvars.ContextVar[CudagraphSession | None] = contextvars.ContextVar(
    "torchloom_cudagraph_session", default=None
)


@contextlib.contextmanager
def cudagraph_session(session: CudagraphSession) -> Iterator[CudagraphSession]:
    """The session runtimes rebuilt from the cache join while the block runs."""
    token = _session.set(session)
    try:
        yield session
    finally:
        _session.reset(token)


def cudagraph_options(options: LoomOptions) -> loom_cudagraph.CudagraphOptions:
    # NOTE: no ``with_env()``: TORCHLOOM_CUDAGRAPH_OR_ERROR is already resolved into
    # the options, below mode= and options=; reading it again here would let it win.
    return loom_cudagraph.CudagraphOptions(
        or_error=options.cudagraph_or_error,
        max_recording=options.cudagraph_max_recording,
        min_segment_nodes=options.cudagraph_min_segment_nodes,
        max_shapes=options.cudagraph_max_shapes,
        capture_collectives=options.cudagraph_capture_collectives,
    )


def cudagraph_settings(
    options: LoomOptions, capturer: loom_cudagraph.Capturer | None, device: str | None
) -> Mapping[str, Any] | None:
    """Everything beyond the options that decides the plans (the cache key's
    ``cudagraph`` component): the effective options, the op registry, the capturer
    and, where collectives are captured, the process groups whose collectives can be
    (a plan that captured an NCCL group's collectives must not serve a run whose group
    of that name is gloo, nor the other way round); ``None`` without CUDA graphs."""
    if not options.cudagraphs:
        return None
    groups: tuple[str, ...] = ()
    if options.cudagraph_capture_collectives:
        device_type = torch.device(device).type if device else "cuda"
        groups = loom_cudagraph.capturable_groups(device_type)
    return {
        "capturable_groups": list(groups),
        **cudagraph_options(options).to_dict(),
        "rules": sorted(
            f"{r.name}: {r.kind.value}: {r.explanation} ({r.hint})"
            for r in loom_cudagraph.registered_rules()
        ),
        "capturer": type(capturer).__name__ if capturer else "cuda",
        "device": device,
    }


def cudagraph_error(exc: BaseException) -> loom_cudagraph.CudagraphError | None:
    """The ``CudagraphError`` somewhere in ``exc``'s cause chain, if any: it is a
    request to fail (``cudagraph_or_error``), never a reason to fall back."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, loom_cudagraph.CudagraphError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _listener(record: GraphRecordBuilder) -> Callable[[loom_cudagraph.SegmentStats, str], None]:
    """Runtime events (recordings, budget skips) become report entries of the graph."""

    def listen(stats: loom_cudagraph.SegmentStats, event: str) -> None:
        kind = "recording" if event == "recorded" else "runtime-skip"
        detail = "" if event == "recorded" else f": {event}"
        record.add_entry(
            "cudagraph",
            kind,
            f"{stats.name}: {stats.recordings} recordings, {stats.shapes} shapes, "
            f"{stats.pool_bytes} pool bytes{detail}",
            segment=stats.name,
            recordings=stats.recordings,
            pool_bytes=stats.pool_bytes,
        )

    return listen


def _outcome(session: CudagraphSession, plan: loom_cudagraph.PartitionPlan) -> PlanOutcome:
    if plan.device is None:
        return PlanOutcome.NO_DEVICE
    if session.capturer is None and not torch.cuda.is_available():
        return PlanOutcome.DISABLED
    return PlanOutcome.CAPTURED if plan.captured_segments else PlanOutcome.UNCAPTURED


def _report_plan(
    record: GraphRecordBuilder, plan: loom_cudagraph.PartitionPlan, outcome: PlanOutcome
) -> None:
    """The plan's report entries, then (when it runs on a device) its skips logged,
    counted and raised under or_error."""
    record.add_plan(f"cudagraph.{plan.graph.rsplit(' ', 1)[-1]}", plan)  # "cudagraph.forward"
    for seg in plan.segments:
        state = "captured" if seg.captured else "uncaptured"
        reasons = "; ".join(str(r) for r in seg.reasons)
        message = f"{plan.graph} {seg.name}: {state}, {len(seg.nodes)} nodes"
        record.add_entry(
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
        record.add_entry(
            "cudagraph", "skip", f"{plan.graph}: {reason}", kind_=reason.kind.value, refusal=reason
        )
    if outcome is PlanOutcome.DISABLED:
        record.add_entry("cudagraph", "disabled", f"{plan.graph}: no CUDA device available")
    elif outcome in (PlanOutcome.CAPTURED, PlanOutcome.UNCAPTURED):
        loom_cudagraph.report_plan_skips(plan)


def compile_segmented(
    session: CudagraphSession,
    options: LoomOptions,
    plan_graph: PlanFn,
    gm: GraphModule,
    kind: GraphKind,
    example_inputs: Sequence[Any],
    static_input_idxs: Sequence[int],
    codegen: Codegen,
) -> SegmentedOutputCode | None:
    """Plan ``gm``, compile its segments and assemble the runtime; ``None`` when
    nothing is captured (the graph then compiles whole, its skips still logged,
    counted and raised under ``or_error``)."""
    # NOTE: a backward's "fixed" inputs are saved activations, not parameters;
    # the runtime finds parameters and loom-managed tensors itself.
    static = () if kind is GraphKind.BACKWARD else tuple(static_input_idxs)
    plan = plan_graph(
        gm,
        example_inputs,
        static,
        cudagraph_options(options),
        name=session.graph_name(kind),
        device=session.device,
    )
    outcome = _outcome(session, plan)
    session.plans.append(StoredPlan(kind, outcome, plan.to_json()))
    _report_plan(session.record, plan, outcome)
    if outcome is not PlanOutcome.CAPTURED:
        return None
    pool = session.pool_for(plan)
    eager = options.codegen == "eager"
    with compat.segment_codegen_strides(gm) as before_segment:

        def compile_segment(
            seg: GraphModule, inputs: list[Any], seg_static: tuple[int, ...]
        ) -> Callable[[list[Any]], Sequence[Any]]:
            before_segment(seg)
            if eager:  # an OutputCode, so the compiled graph can be cached
                return EagerOutputCode(seg)
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
        capturer=session.capturer,
        listener=_listener(session.record),
        report_skips=False,
    )
    code = SegmentedOutputCode(
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
    return code


def replay_plans(session: CudagraphSession, payload: Sequence[Any]) -> None:
    """A hit: the cold compile's entries and skip messages, from its stored plans."""
    for item in payload:
        stored = StoredPlan.from_payload(item)
        plan = loom_cudagraph.PartitionPlan.from_json(stored.plan_json)
        plan = dataclasses.replace(plan, graph=session.graph_name(stored.kind))
        _report_plan(session.record, plan, stored.outcome)


def _runtime_from_code(code: SegmentedOutputCode) -> Callable[[list[Any]], Any]:
    """Rebuild the runtime of a cached graph from its stored plan and segments.

    Inside a loom compilation (a cache hit) the runtime joins that graph as the
    cold one did: named after it, sharing its pool, reporting recordings to its
    record; :func:`replay_plans` reports the plan's skips. Outside one, it reports
    the skips itself.
    """
    plan = loom_cudagraph.PartitionPlan.from_json(code.plan_json)
    session = _session.get()
    capturer, pool, listener = None, code.pool, None
    if session is not None:
        kind = GraphKind.BACKWARD if code.is_backward else GraphKind.FORWARD
        kind = GraphKind.INFERENCE if code.is_inference else kind
        plan = dataclasses.replace(plan, graph=session.graph_name(kind))
        capturer, pool = session.capturer, session.pool_for(plan)
        listener = _listener(session.record)
    runtime = loom_cudagraph.assemble_runtime(
        plan,
        code.segments,
        output_constants=code.output_constants,
        pool=pool or loom_cudagraph.new_pool(plan.device, capturer),
        capturer=capturer,
        listener=listener,
        report_skips=session is None,
    )
    _runtimes.append(runtime)
    return runtime
