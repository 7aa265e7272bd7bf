"""The partition plan: which parts of an aten graph run as CUDA graphs, and why not.

:func:`plan_graph` classifies every node (:func:`classify_node`), then splits
the graph into maximal capturable segments and the uncaptured rest. A node is
scheduled into the earliest segment its inputs allow, so independent
capturable work on both sides of a host op joins one segment; nodes with side
effects (mutations, RNG draws, impure ops) keep their original order. The plan
is plain data (names, never ``fx.Node``), checked by :meth:`PartitionPlan.check`
and round-tripped through :meth:`PartitionPlan.to_dict` for the cache.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx

from loom_cudagraph._classify import (
    classify_node,
    first_use_source,
    source_location,
    touches_device,
)
from loom_cudagraph._collectives import is_launch, unpaired
from loom_cudagraph._options import CudagraphOptions
from loom_cudagraph._reasons import CudagraphRefusalKind, Unsupported
from loom_cudagraph._registry import op_name
from loom_cudagraph._torch_compat import OpOverload, is_mutable_op, mutated_args

__all__ = ["PartitionPlan", "PlanError", "SegmentPlan", "plan_graph"]

PLAN_FORMAT = 1


class PlanError(ValueError):
    """A :class:`PartitionPlan` broke one of its invariants."""


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentPlan:
    """A run of nodes executed together, captured or not.

    ``inputs`` name graph placeholders or outputs of earlier segments;
    ``outputs`` name values later segments or the graph output read, plus
    ``passthrough`` inputs returned unchanged so that later captured segments
    read this segment's static copy instead of copying the input again.
    """

    index: int
    nodes: tuple[str, ...]
    captured: bool
    reasons: tuple[Unsupported, ...]
    cuda_work: bool
    work_nodes: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    passthrough: tuple[str, ...] = ()
    mutated_inputs: tuple[str, ...] = ()
    #: For each input, the user's source line of its first use (for messages).
    input_sources: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"segment_{self.index}"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reasons"] = [r.to_dict() for r in self.reasons]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SegmentPlan:
        return cls(
            index=data["index"],
            nodes=tuple(data["nodes"]),
            captured=data["captured"],
            reasons=tuple(Unsupported.from_dict(r) for r in data["reasons"]),
            cuda_work=data["cuda_work"],
            work_nodes=data["work_nodes"],
            inputs=tuple(data["inputs"]),
            outputs=tuple(data["outputs"]),
            passthrough=tuple(data["passthrough"]),
            mutated_inputs=tuple(data["mutated_inputs"]),
            input_sources=tuple(data.get("input_sources", ())),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionPlan:
    """The segments of one graph and every reason a part runs uncaptured.

    >>> plan = plan_graph(gm, example_inputs, static_input_indices=(0,))  # doctest: +SKIP
    >>> [(s.name, s.captured) for s in plan.segments]                      # doctest: +SKIP
    [('segment_0', True), ('segment_1', False), ('segment_2', True)]
    """

    graph: str
    device: str | None
    placeholders: tuple[str, ...]
    static_inputs: tuple[int, ...]
    dynamic: bool
    segments: tuple[SegmentPlan, ...]
    options: CudagraphOptions
    graph_outputs: tuple[str | None, ...] = ()

    @property
    def captured_segments(self) -> tuple[SegmentPlan, ...]:
        return tuple(s for s in self.segments if s.captured)

    def skips(self) -> tuple[Unsupported, ...]:
        """Reasons of uncaptured segments that hold CUDA work, in graph order."""
        return tuple(r for s in self.segments if not s.captured for r in s.reasons if r.cuda_work)

    def summary(self) -> str:
        """One line per segment: captured or not, node count, reasons."""
        lines = [
            f"{self.graph} on {self.device or 'no CUDA device'}: {len(self.segments)} segments"
        ]
        for s in self.segments:
            state = "captured" if s.captured else "uncaptured"
            lines.append(f"  {s.name}: {state}, {s.work_nodes} work nodes / {len(s.nodes)} nodes")
            lines.extend(f"    {r}" for r in s.reasons)
        return "\n".join(lines)

    def check(self) -> None:
        """Raise :class:`PlanError` when an invariant is broken."""
        seen: set[str] = set()
        available = set(self.placeholders)
        for pos, seg in enumerate(self.segments):
            if seg.index != pos:
                raise PlanError(f"{seg.name}: index {seg.index} at position {pos}")
            if seg.captured == bool(seg.reasons):
                state = "captured" if seg.captured else "uncaptured"
                raise PlanError(f"{seg.name}: {state} with {len(seg.reasons)} reasons")
            if not seg.nodes:
                raise PlanError(f"{seg.name}: empty segment")
            for name in seg.nodes:
                if name in seen:
                    raise PlanError(f"{seg.name}: node {name} is in two segments")
                seen.add(name)
            for name in seg.inputs:
                if name not in available:
                    raise PlanError(f"{seg.name}: input {name} is not produced before it")
            if not set(seg.passthrough) <= set(seg.inputs) & set(seg.outputs):
                raise PlanError(
                    f"{seg.name}: passthrough {seg.passthrough} not both input and output"
                )
            if seg.passthrough and not seg.captured:
                raise PlanError(f"{seg.name}: uncaptured segment with passthrough outputs")
            for name in seg.outputs:
                if name not in seg.nodes and name not in seg.passthrough:
                    raise PlanError(f"{seg.name}: output {name} is not computed here")
            available.update(seg.outputs)
        for out in self.graph_outputs:
            if out is not None and out not in available:
                raise PlanError(f"graph output {out} is produced by no segment")
        if any(i < 0 or i >= len(self.placeholders) for i in self.static_inputs):
            raise PlanError(f"static input index out of range: {self.static_inputs}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "graph": self.graph,
            "device": self.device,
            "placeholders": list(self.placeholders),
            "static_inputs": list(self.static_inputs),
            "dynamic": self.dynamic,
            "segments": [s.to_dict() for s in self.segments],
            "options": self.options.to_dict(),
            "graph_outputs": list(self.graph_outputs),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PartitionPlan:
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan format {data.get('format')!r}, expected {PLAN_FORMAT}")
        return cls(
            graph=data["graph"],
            device=data["device"],
            placeholders=tuple(data["placeholders"]),
            static_inputs=tuple(data["static_inputs"]),
            dynamic=data["dynamic"],
            segments=tuple(SegmentPlan.from_dict(s) for s in data["segments"]),
            options=CudagraphOptions.from_dict(data["options"]),
            graph_outputs=tuple(data["graph_outputs"]),
        )

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        return cls.from_dict(json.loads(text))


# --- planning ---------------------------------------------------------------------------


def _graph_device(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.device | None:
    candidates: list[Any] = list(example_inputs)
    candidates += [n.meta.get("val") for n in gm.graph.nodes]
    for v in candidates:
        for t in v if isinstance(v, list | tuple) else (v,):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                return torch.device("cuda", t.device.index or 0)
    return None


def _capture_device(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: torch.device | str | None
) -> torch.device | None:
    """The device whose work is captured, always with an index when it is CUDA.

    An index-less ``"cuda"`` means the graph's own CUDA device (else the current
    one): the graph's tensors carry an index, and ``cuda:0 != cuda`` would refuse
    every node as on another device.
    """
    if device is None:
        return _graph_device(gm, example_inputs)
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    found = _graph_device(gm, example_inputs)
    if found is not None:
        return found
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


def _is_dynamic(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt):
            return True
        if isinstance(v, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())
        ):
            return True
    return any(isinstance(v, torch.SymInt) for v in example_inputs)


def _is_ordered(node: torch.fx.Node) -> bool:
    """Nodes whose relative order must survive scheduling: effects and RNG draws."""
    target = node.target
    if isinstance(target, OpOverload):
        if is_mutable_op(target) or torch.Tag.nondeterministic_seeded in target.tags:
            return True
    return node.is_impure()


def _work(node: torch.fx.Node, device: torch.device | None) -> bool:
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and touches_device(node, device)
    )


class _Scheduler:
    """Assigns every call node a level: even levels captured, odd levels uncaptured."""

    def __init__(self, nodes: list[torch.fx.Node], refusals: dict[torch.fx.Node, Unsupported]):
        self.nodes = nodes
        self.refusals = refusals
        self.level: dict[torch.fx.Node, int] = {}
        #: collectives, uncaptured (kind COLLECTIVE) or captured launches
        self.barriers = {n for n in nodes if self._is_barrier(n)}

    def _is_barrier(self, n: torch.fx.Node) -> bool:
        refusal = self.refusals.get(n)
        if refusal is None:
            return is_launch(n)
        return refusal.kind is CudagraphRefusalKind.COLLECTIVE

    def _deps(self) -> dict[torch.fx.Node, list[torch.fx.Node]]:
        deps = {n: [a for a in n.all_input_nodes if a.op != "placeholder"] for n in self.nodes}
        last_ordered: torch.fx.Node | None = None
        users_so_far: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        last_writer: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in self.nodes:
            if _is_ordered(n):
                if last_ordered is not None:
                    deps[n].append(last_ordered)
                last_ordered = n
            for a in n.all_input_nodes:
                if a in last_writer and last_writer[a] is not n:
                    deps[n].append(last_writer[a])
            for a in mutated_args(n.target, n.args, dict(n.kwargs)):
                if isinstance(a, torch.fx.Node):
                    deps[n].extend(u for u in users_so_far.get(a, ()) if u is not n)
                    last_writer[a] = n
            for a in n.all_input_nodes:
                users_so_far.setdefault(a, []).append(n)
        return deps

    def run(self) -> dict[torch.fx.Node, int]:
        deps = self._deps()
        # NOTE: a collective is a barrier: it moves above no node that precedes it.
        # Hoisted (it depends on graph inputs alone), every all-gather of an FSDP2
        # graph would run first and every layer's unsharded parameters live at once,
        # as would every gradient before the first reduce-scatter; kept in program
        # order, segments follow the per-layer order FSDP2's memory plan relies on.
        # A captured collective is one too (hoisted into an earlier segment, it would
        # gather early all the same); its wait is not (it may join its collective).
        high = 0
        for n in self.nodes:
            floor = max((self.level[d] for d in deps[n] if d in self.level), default=0)
            if n.target is operator.getitem and n.args and n.args[0] in self.level:
                self.level[n] = self.level[n.args[0]]  # type: ignore[index]
                continue
            refusal = self.refusals.get(n)
            if n in self.barriers:
                floor = max(floor, high)
            parity = 1 if refusal is not None else 0
            self.level[n] = level = floor if floor % 2 == parity else floor + 1
            high = max(high, level)
        return self.level


def _segment_io(
    members: list[list[torch.fx.Node]], output_node: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> list[tuple[list[torch.fx.Node], list[torch.fx.Node]]]:
    owner = {n: i for i, seg in enumerate(members) for n in seg}
    io = []
    for i, seg in enumerate(members):
        inside = set(seg)
        inputs = {a for n in seg for a in n.all_input_nodes if a not in inside}
        outputs = [n for n in seg if any(u is output_node or owner.get(u, i) > i for u in n.users)]
        io.append((sorted(inputs, key=order.__getitem__), outputs))
    return io


def plan_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    static_input_indices: Iterable[int] = (),
    options: CudagraphOptions | None = None,
    *,
    name: str = "graph",
    device: torch.device | str | None = None,
) -> PartitionPlan:
    """Plan which parts of a post-AOT aten graph run as CUDA graphs.

    ``static_input_indices`` are the placeholders AOTAutograd reports as
    parameters and buffers (used in place, never copied). Pure analysis: the
    graph is not modified and no device is needed. ``device`` overrides the
    captured device (default: the graph's first CUDA device).

    >>> plan = plan_graph(gm, fake_inputs, static_input_indices=(0, 1))  # doctest: +SKIP
    >>> plan.check(); print(plan.summary())                              # doctest: +SKIP
    """
    options = options or CudagraphOptions()
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    output_node = graph.output_node()
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    device = _capture_device(gm, example_inputs, device)

    refusals = _classify(calls, device, options)
    merged = _paired_segments(calls, refusals, device, options, order)
    io = _segment_io([m[0] for m in merged], output_node, order)
    static = frozenset(static_input_indices)
    mutated = _mutated_inputs(merged)
    passthrough = _passthrough(merged, io, placeholders, static, mutated)

    segments = []
    for i, (seg, is_captured, reasons) in enumerate(merged):
        inputs, outputs = io[i]
        through = passthrough.get(i, [])
        segments.append(
            SegmentPlan(
                index=i,
                nodes=tuple(n.name for n in seg),
                captured=is_captured,
                reasons=() if is_captured else _dedup(reasons),
                cuda_work=any(_work(n, device) for n in seg),
                work_nodes=sum(_work(n, device) for n in seg),
                inputs=tuple(a.name for a in inputs),
                outputs=tuple(n.name for n in [*outputs, *through]),
                passthrough=tuple(a.name for a in through),
                input_sources=tuple(first_use_source(a) for a in inputs),
                mutated_inputs=tuple(
                    sorted(
                        (a.name for a in mutated.get(i, ())),
                        key=[p.name for p in placeholders].index,
                    )
                ),
            )
        )
    outs = output_node.args[0]
    flat_outs = outs if isinstance(outs, list | tuple) else (outs,)
    plan = PartitionPlan(
        graph=name,
        device=str(device) if device is not None else None,
        placeholders=tuple(p.name for p in placeholders),
        static_inputs=tuple(sorted(static)),
        dynamic=_is_dynamic(gm, example_inputs),
        segments=tuple(segments),
        options=options,
        graph_outputs=tuple(o.name if isinstance(o, torch.fx.Node) else None for o in flat_outs),
    )
    plan.check()
    return plan


#: A segment being planned: its nodes, whether it is captured, why not.
_Draft = tuple[list[torch.fx.Node], bool, list[Unsupported]]


def _classify(
    calls: list[torch.fx.Node], device: torch.device | None, options: CudagraphOptions
) -> dict[torch.fx.Node, Unsupported]:
    """Phase 1: why each node that cannot be captured cannot (every node without a device)."""
    refusals: dict[torch.fx.Node, Unsupported] = {}
    for n in calls:
        reason = classify_node(n, device, capture_collectives=options.capture_collectives)
        if reason is not None:
            refusals[n] = reason
    if device is None:
        for n in calls:
            refusals.setdefault(
                n,
                Unsupported(
                    CudagraphRefusalKind.DISABLED,
                    source_location(n),
                    "the graph has no CUDA tensors",
                    cuda_work=False,
                ),
            )
    return refusals


def _paired_segments(
    calls: list[torch.fx.Node],
    refusals: dict[torch.fx.Node, Unsupported],
    device: torch.device | None,
    options: CudagraphOptions,
    order: dict[torch.fx.Node, int],
) -> list[_Draft]:
    """Phase 2: :func:`_segments`, with each captured collective in the segment of its
    waits: a collective or wait refused leaves its partners uncaptured too, and a pair
    the schedule split is refused and the graph scheduled again (``refusals`` grows;
    each round refuses at least one more node, so it ends)."""

    def refuse(found: dict[torch.fx.Node, str]) -> None:
        for n, why in found.items():
            refusals[n] = Unsupported(
                CudagraphRefusalKind.COLLECTIVE,
                source_location(n),
                why,
                "",
                op_name(n.target),
                touches_device(n, device),
            )

    refuse(unpaired(calls, refusals.keys()))
    while True:
        merged = _segments(calls, refusals, device, options, order)
        segment_of = {n: i for i, (seg, _, _) in enumerate(merged) for n in seg}
        split = unpaired(calls, refusals.keys(), segment_of)
        if not split:
            return merged
        refuse(split)


def _segments(
    calls: list[torch.fx.Node],
    refusals: dict[torch.fx.Node, Unsupported],
    device: torch.device | None,
    options: CudagraphOptions,
    order: dict[torch.fx.Node, int],
) -> list[_Draft]:
    """Nodes scheduled into alternating segments; segments too small to pay
    for capture demoted, then uncaptured neighbours merged."""
    levels = _Scheduler(calls, refusals).run()
    by_level: dict[int, list[torch.fx.Node]] = {}
    for n in calls:
        by_level.setdefault(levels[n], []).append(n)
    members = [by_level[k] for k in sorted(by_level)]

    captured = [all(n not in refusals for n in seg) for seg in members]
    work = [sum(_work(n, device) for n in seg) for seg in members]
    small: dict[int, Unsupported] = {}
    for i, seg in enumerate(members):
        if captured[i] and work[i] < options.min_segment_nodes:
            captured[i] = False
            first = next((n for n in seg if _work(n, device)), seg[0])
            small[i] = Unsupported(
                CudagraphRefusalKind.TOO_SMALL,
                source_location(first),
                f"segment of {work[i]} work nodes is below min_segment_nodes={options.min_segment_nodes}",
                "lower cudagraph_min_segment_nodes to capture it",
                cuda_work=work[i] > 0,
            )
    merged: list[_Draft] = []
    for i, seg in enumerate(members):
        reasons = [refusals[n] for n in seg if n in refusals]
        if i in small:
            reasons.append(small[i])
        if merged and not captured[i] and not merged[-1][1]:
            merged[-1][0].extend(seg)
            merged[-1][2].extend(reasons)
        else:
            merged.append((list(seg), captured[i], reasons))
    for seg, _, _ in merged:
        seg.sort(key=order.__getitem__)
    return merged


def _mutated_inputs(merged: list[_Draft]) -> dict[int, set[torch.fx.Node]]:
    """Phase 3: the graph inputs each segment mutates, by segment index."""
    mutated: dict[int, set[torch.fx.Node]] = {}
    for i, (seg, _, _) in enumerate(merged):
        for n in seg:
            for a in mutated_args(n.target, n.args, dict(n.kwargs)):
                if isinstance(a, torch.fx.Node) and a.op == "placeholder":
                    mutated.setdefault(i, set()).add(a)
    return mutated


def _passthrough(
    merged: list[_Draft],
    io: list[tuple[list[torch.fx.Node], list[torch.fx.Node]]],
    placeholders: list[torch.fx.Node],
    static: frozenset[int],
    mutated: dict[int, set[torch.fx.Node]],
) -> dict[int, list[torch.fx.Node]]:
    """Phase 4: a copied input that a later captured segment reads again is returned
    by the first captured segment that reads it, so the later one uses its static copy."""
    placeholder_index = {p: i for i, p in enumerate(placeholders)}
    ever_mutated = set().union(*mutated.values()) if mutated else set()
    passthrough: dict[int, list[torch.fx.Node]] = {}
    passed: set[torch.fx.Node] = set()
    for i, (_, is_captured, _) in enumerate(merged):
        if not is_captured:
            continue
        for a in io[i][0]:
            if (
                a.op == "placeholder"
                and placeholder_index[a] not in static
                and a not in passed
                and a not in ever_mutated
                and isinstance(a.meta.get("val"), torch.Tensor)
                and any(merged[j][1] and a in io[j][0] for j in range(i + 1, len(merged)))
            ):
                passthrough.setdefault(i, []).append(a)
                passed.add(a)
    return passthrough


def _dedup(reasons: list[Unsupported]) -> tuple[Unsupported, ...]:
    return tuple(dict.fromkeys(reasons))
