"""Cut a graph into one ``GraphModule`` per segment of a :class:`PartitionPlan`.

Each segment module takes the segment's inputs as placeholders (named as in
the original graph, in plan order) and returns a tuple of its outputs; a
passthrough output returns its placeholder unchanged. Node meta (``val``,
``stack_trace``) is kept so a code generator and the error messages see what
the whole graph had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from loom_cudagraph._plan import PartitionPlan, PlanError, SegmentPlan

__all__ = ["SegmentModule", "split_by_plan"]


class SegmentModule:
    """A segment's graph module, its example inputs and each input's source line."""

    __slots__ = ("example_inputs", "gm", "input_sources", "plan")

    def __init__(
        self,
        plan: SegmentPlan,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        input_sources: tuple[str, ...],
    ) -> None:
        self.plan = plan
        self.gm = gm
        self.example_inputs = example_inputs
        self.input_sources = input_sources


def split_by_plan(
    gm: torch.fx.GraphModule, plan: PartitionPlan, example_inputs: Sequence[Any]
) -> list[SegmentModule]:
    """One :class:`SegmentModule` per segment of ``plan``, in plan order.

    >>> [m.gm.graph for m in split_by_plan(gm, plan, example_inputs)]  # doctest: +SKIP
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    if tuple(placeholders) != plan.placeholders:
        raise PlanError(f"plan placeholders {plan.placeholders} do not match graph {placeholders}")
    examples = dict(zip(placeholders, example_inputs, strict=False))
    out = []
    for seg in plan.segments:
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for name in seg.inputs:
            src = nodes[name]
            ph = g.placeholder(name)
            ph.meta = dict(src.meta)
            env[src] = ph
        for name in seg.nodes:
            src = nodes[name]
            env[src] = g.node_copy(src, env.__getitem__)
        g.output(tuple(env[nodes[name]] for name in seg.outputs))
        module = torch.fx.GraphModule(gm, g, class_name=seg.name)
        module.graph.lint()  # type: ignore[no-untyped-call]
        inputs = [examples[n] if n in examples else nodes[n].meta.get("val") for n in seg.inputs]
        out.append(SegmentModule(seg, module, inputs, seg.input_sources))
    return out
