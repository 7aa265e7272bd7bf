"""The boxed callable that runs a planned graph: captured segments as CUDA
graphs, the rest through their compiled code, values passed in a flat list.

:func:`build_runtime` splits the graph by the plan, hands each segment to the
caller's code generator, wraps capturable ones in :class:`CapturedSegment` and
precomputes every index the per-call loop needs: which slots a segment reads,
where its outputs go, and which slots die after it (inputs are freed as early
as eager frees them). A graph with nothing to capture is compiled whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from loom_cudagraph._capture import Capturer, CudaCapturer
from loom_cudagraph._live import live_runtimes
from loom_cudagraph._plan import PartitionPlan, SegmentPlan
from loom_cudagraph._pool import MemoryPool
from loom_cudagraph._segment import CapturedSegment, Listener, SegmentSpec, SegmentStats
from loom_cudagraph._skiplog import report_plan_skips
from loom_cudagraph._split import split_by_plan
from loom_cudagraph._torch_compat import mark_boxed

__all__ = [
    "CompileSegment",
    "CudagraphRuntime",
    "RuntimeCall",
    "RuntimeStats",
    "assemble_runtime",
    "build_runtime",
    "compile_segments",
    "eager_segment_compiler",
    "new_pool",
]

BoxedFn = Callable[[list[Any]], Sequence[Any]]
Step = tuple[BoxedFn, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
#: ``compile_segment(gm, example_inputs, static_input_indices) -> boxed callable``.
CompileSegment = Callable[[torch.fx.GraphModule, list[Any], tuple[int, ...]], BoxedFn]


def eager_segment_compiler(
    gm: torch.fx.GraphModule, example_inputs: list[Any], static_input_indices: tuple[int, ...]
) -> BoxedFn:
    """Run the segment's FX code as is (boxed: the argument list is cleared)."""

    def run(args: list[Any]) -> Sequence[Any]:
        values = list(args)
        args.clear()
        result = gm(*values)
        return result if isinstance(result, list | tuple) else (result,)

    return run


def new_pool(
    device: torch.device | str | None = None, capturer: Capturer | None = None
) -> MemoryPool:
    """A memory pool that the graphs of one compiled function share (forward and backward)."""
    if capturer is None:
        capturer = CudaCapturer(torch.device(device or "cuda"))
    return MemoryPool(capturer.new_pool_handle())


@dataclasses.dataclass(frozen=True, slots=True)
class RuntimeStats:
    """Each segment of one graph as it ran so far."""

    graph: str
    segments: tuple[SegmentStats, ...]

    @property
    def pool_bytes(self) -> int:
        return sum(s.pool_bytes for s in self.segments)

    def format(self) -> str:
        lines = [f"{self.graph}: {len(self.segments)} segments, {self.pool_bytes} pool bytes"]
        for s in self.segments:
            state = "captured" if s.captured else "uncaptured"
            lines.append(
                f"  {s.name}: {state}, {s.nodes} nodes, {s.recordings} recordings, "
                f"{s.replays} replays, {s.uncaptured_calls} uncaptured calls"
            )
            lines.extend(f"    {r}" for r in s.reasons)
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, slots=True)
class RuntimeCall:
    """One call of a runtime, as its caller made it (see :meth:`CudagraphRuntime.record_calls`)."""

    graph: str
    runtime: BoxedFn
    inputs: tuple[Any, ...]


class CudagraphRuntime:
    """A boxed callable running one planned graph; see :func:`build_runtime`."""

    def __init__(
        self,
        plan: PartitionPlan,
        steps: list[Step],
        outputs: list[tuple[int, Any]],
        n_slots: int,
        static_stats: list[SegmentStats | CapturedSegment],
    ) -> None:
        # NOTE: an instance attribute, so wrappers made with functools.wraps
        # (Dynamo's ``disable`` around a backward) keep the boxed convention.
        mark_boxed(self)
        self.plan = plan
        self._steps = steps
        self._outputs = outputs
        self._pad = [None] * (n_slots - len(plan.placeholders))
        self._stats = static_stats
        self._calls: list[RuntimeCall] | None = None
        live_runtimes.add(self)
        # One step reading every input in order and returning the graph's outputs
        # in order: call it directly (the per-call path of a fully captured graph).
        self._single: BoxedFn | None = None
        if len(steps) == 1:
            run, reads, writes, _ = steps[0]
            if reads == tuple(range(len(plan.placeholders))) and [s for s, _ in outputs] == list(
                writes
            ):
                self._single = run

    @classmethod
    @contextlib.contextmanager
    def record_calls(cls) -> Iterator[list[RuntimeCall]]:
        """Record every call of every live runtime while the block runs: a
        debugging and benchmarking aid (the list keeps the calls' inputs alive).

        ``call.runtime(list(call.inputs))`` then runs that graph again exactly as
        its caller (AOTAutograd) did, without the layers above the runtime.

        >>> with CudagraphRuntime.record_calls() as calls:  # doctest: +SKIP
        ...     compiled(x)
        >>> calls[0].runtime(list(calls[0].inputs))  # doctest: +SKIP
        """
        calls: list[RuntimeCall] = []
        runtimes = [r for r in live_runtimes if isinstance(r, cls)]
        for r in runtimes:
            r._calls = calls
        try:
            yield calls
        finally:
            for r in runtimes:
                r._calls = None

    def __call__(self, args: list[Any]) -> list[Any]:
        if self._calls is not None:
            self._calls.append(RuntimeCall(self.plan.graph, self, tuple(args)))
        if self._single is not None:
            return self._single(args)  # type: ignore[return-value]
        env = list(args)
        args.clear()
        env.extend(self._pad)
        for run, reads, writes, frees in self._steps:
            args = [env[i] for i in reads]
            # NOTE: values read for the last time go with the call's list alone,
            # so the step's code frees them as it goes (as eager would), and a
            # capture can reuse their memory.
            for slot in frees:
                env[slot] = None
            results = run(args)
            del args
            for slot, value in zip(writes, results, strict=True):
                env[slot] = value
        return [env[s] if s >= 0 else const for s, const in self._outputs]

    def release(self) -> None:
        """Drop the CUDA graphs of every captured segment (see
        :meth:`CapturedSegment.release`); the runtime stays callable."""
        for s in self._stats:
            if isinstance(s, CapturedSegment):
                s.release()

    def stats(self) -> RuntimeStats:
        segs = tuple(s.stats() if isinstance(s, CapturedSegment) else s for s in self._stats)
        return RuntimeStats(self.plan.graph, segs)


def _uncaptured_stats(plan: PartitionPlan, index: int, name: str) -> SegmentStats:
    seg = plan.segments[index]
    return SegmentStats(name, False, seg.reasons, len(seg.nodes), 0, 0, 0, 0, 0)


def compile_segments(
    plan: PartitionPlan,
    gm: torch.fx.GraphModule,
    compile_segment: CompileSegment | None = None,
    example_inputs: Sequence[Any] = (),
) -> list[BoxedFn]:
    """Each segment's compiled code, in plan order (the whole graph as one piece
    when nothing is captured)."""
    compile_segment = compile_segment or eager_segment_compiler
    if not plan.captured_segments:
        return [compile_segment(gm, list(example_inputs), plan.static_inputs)]
    slot = {name: i for i, name in enumerate(plan.placeholders)}
    fns = []
    for seg, module in zip(plan.segments, split_by_plan(gm, plan, example_inputs), strict=True):
        static = tuple(
            i for i, n in enumerate(seg.inputs) if n in slot and slot[n] in plan.static_inputs
        )
        fns.append(compile_segment(module.gm, module.example_inputs, static))
    return fns


def build_runtime(
    plan: PartitionPlan,
    gm: torch.fx.GraphModule,
    compile_segment: CompileSegment | None = None,
    example_inputs: Sequence[Any] = (),
    *,
    pool: MemoryPool | None = None,
    capturer: Capturer | None = None,
    listener: Listener | None = None,
) -> CudagraphRuntime:
    """A boxed callable that runs ``gm`` by ``plan``, capturing what the plan allows.

    ``compile_segment`` defaults to :func:`eager_segment_compiler`;
    ``listener(stats, event)`` hears of each recording and runtime skip. Skips in
    the plan are logged and counted first (and raise under ``or_error``), so a
    compile that succeeds has no silent skip.

    >>> plan = plan_graph(gm, example_inputs, static_input_indices=(0,))   # doctest: +SKIP
    >>> run = build_runtime(plan, gm, compile_segment, example_inputs, pool=new_pool())
    >>> outs = run(list(real_inputs))                                      # doctest: +SKIP
    """
    report_plan_skips(plan)
    fns = compile_segments(plan, gm, compile_segment, example_inputs)
    node_outputs = gm.graph.output_node().args[0]
    flat = list(node_outputs) if isinstance(node_outputs, list | tuple) else [node_outputs]
    constants = tuple(None if isinstance(o, torch.fx.Node) else o for o in flat)
    return assemble_runtime(
        plan,
        fns,
        output_constants=constants,
        pool=pool,
        capturer=capturer,
        listener=listener,
        report_skips=False,
    )


def assemble_runtime(
    plan: PartitionPlan,
    segment_fns: Sequence[BoxedFn],
    *,
    output_constants: Sequence[Any] | None = None,
    pool: MemoryPool | None = None,
    capturer: Capturer | None = None,
    listener: Listener | None = None,
    report_skips: bool = True,
) -> CudagraphRuntime:
    """The runtime from already compiled segments (what :func:`compile_segments`
    returned, or their cached copies): a cache hit needs no graph module and
    reports the same skips as the cold compile.

    ``output_constants`` gives the graph's non-tensor outputs, aligned with
    ``plan.graph_outputs`` (``None`` where the output is a node).
    """
    if report_skips:
        report_plan_skips(plan)
    constants = list(output_constants or [None] * len(plan.graph_outputs))
    if not plan.captured_segments:
        (fn,) = segment_fns
        return _whole_graph_runtime(plan, fn)
    device = torch.device(plan.device) if plan.device else None
    if capturer is None:
        capturer = CudaCapturer(device or torch.device("cuda"))
    layout = _SlotLayout.of(plan)
    graph_outputs = {o for o in plan.graph_outputs if o is not None}
    steps: list[Step] = []
    stats: list[SegmentStats | CapturedSegment] = []
    for k, (seg, fn) in enumerate(zip(plan.segments, segment_fns, strict=True)):
        name = f"{plan.graph}/{seg.name}"
        run: BoxedFn
        if seg.captured:
            spec = _segment_spec(plan, seg, name, graph_outputs)
            captured = CapturedSegment(fn, spec, capturer, device, pool, listener)
            run = captured
            stats.append(captured)
        else:
            run = fn
            stats.append(_uncaptured_stats(plan, k, name))
        steps.append((run, layout.reads[k], layout.writes[k], layout.frees[k]))
    final = layout.final
    outputs: list[tuple[int, Any]] = [
        (final[o], None) if o is not None else (-1, c)
        for o, c in zip(plan.graph_outputs, constants, strict=True)
    ]
    return CudagraphRuntime(plan, steps, outputs, layout.n_slots, stats)


def _whole_graph_runtime(plan: PartitionPlan, fn: BoxedFn) -> CudagraphRuntime:
    """Nothing captured: one step runs the whole graph."""
    n_inputs = len(plan.placeholders)
    writes = tuple(range(n_inputs, n_inputs + len(plan.graph_outputs)))
    stats: list[SegmentStats | CapturedSegment] = [
        _uncaptured_stats(plan, i, f"{plan.graph}/{s.name}") for i, s in enumerate(plan.segments)
    ]
    whole: list[tuple[int, Any]] = [(slot, None) for slot in writes]
    return CudagraphRuntime(
        plan, [(fn, tuple(range(n_inputs)), writes, ())], whole, n_inputs + len(writes), stats
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _SlotLayout:
    """Where each segment reads its inputs and writes its outputs in the runtime's
    value list, which slots it frees after running, and each value's final slot."""

    reads: tuple[tuple[int, ...], ...]
    writes: tuple[tuple[int, ...], ...]
    frees: tuple[tuple[int, ...], ...]
    final: dict[str, int]
    n_slots: int

    @staticmethod
    def of(plan: PartitionPlan) -> _SlotLayout:
        placeholder_slot = {name: i for i, name in enumerate(plan.placeholders)}
        graph_outputs = {o for o in plan.graph_outputs if o is not None}
        # ``read`` maps a value name to the slot later segments read it from.
        read = dict(placeholder_slot)
        final: dict[str, int] = dict(placeholder_slot)
        n_slots = len(plan.placeholders)
        seg_reads: list[tuple[int, ...]] = []
        seg_writes: list[tuple[int, ...]] = []
        for seg in plan.segments:
            seg_reads.append(tuple(read[name] for name in seg.inputs))
            writes = []
            for name in seg.outputs:
                writes.append(n_slots)
                read[name] = n_slots
                if name not in seg.passthrough:
                    final[name] = n_slots
                n_slots += 1
            seg_writes.append(tuple(writes))
        last_read: dict[int, int] = {}
        for k, reads in enumerate(seg_reads):
            for slot in reads:
                last_read[slot] = k
        keep = {final[o] for o in graph_outputs}
        frees: list[list[int]] = [[] for _ in plan.segments]
        for slot, k in last_read.items():
            if slot not in keep:
                frees[k].append(slot)
        return _SlotLayout(
            tuple(seg_reads),
            tuple(seg_writes),
            tuple(tuple(sorted(f)) for f in frees),
            final,
            n_slots,
        )


def _segment_spec(
    plan: PartitionPlan, seg: SegmentPlan, name: str, graph_outputs: set[str]
) -> SegmentSpec:
    """What a captured segment's runtime needs to know of its inputs and outputs."""
    placeholder_slot = {n: i for i, n in enumerate(plan.placeholders)}
    return SegmentSpec(
        name=name,
        input_names=seg.inputs,
        input_sources=seg.input_sources or tuple("" for _ in seg.inputs),
        static_positions=frozenset(
            i
            for i, n in enumerate(seg.inputs)
            if n in placeholder_slot and placeholder_slot[n] in plan.static_inputs
        ),
        mutated_positions=frozenset(i for i, n in enumerate(seg.inputs) if n in seg.mutated_inputs),
        escaping_outputs=frozenset(
            i for i, n in enumerate(seg.outputs) if n in graph_outputs and n not in seg.passthrough
        ),
        dynamic=plan.dynamic,
        options=plan.options,
        nodes=len(seg.nodes),
        passthrough=tuple((seg.outputs.index(n), seg.inputs.index(n)) for n in seg.passthrough),
    )
