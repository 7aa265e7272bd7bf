"""Remove ``resize_(full) -> copy_ -> resize_(0)`` chains on graph inputs.

Between the fill and the resize back to zero, every use of the input reads
the fill's source instead, and the three mutations go away: the full-size
parameter storage is never allocated. The input itself stays what the graph
returns (what autograd saves for backward), so backward sees the original
zero-storage parameter, as in eager. A read of the input's data after its
resize to 0 (before it is grown again) reads freed storage; it joins the
chain's uses, as if the free had come after it. Runs on AOTAutograd's aten graphs
(forward, backward, inference), after gradients have been decided; on the
Dynamo graph it would cut the parameter out of autograd.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Node

from loom_resize import _torch_compat as compat
from loom_resize._errors import ResizeRefusalKind, Unsupported
from loom_resize._nodes import (
    example_value,
    fill_pairs,
    finish_graph,
    is_fill,
    is_resize,
    resize_size,
)
from loom_resize._plan import ResizeCase, plan_storage_resizes
from loom_sidefx import Change, PassResult

__all__ = ["remove_resize_copy_resize"]

log = logging.getLogger("torchloom.resize")
PASS = "remove_resize_copy_resize"


def _writes(node: Node, target: Node) -> bool:
    """True if ``node`` mutates ``target`` (by schema, or a Dynamo ``x.foo_()`` method)."""
    if node.op == "call_method":
        return (
            isinstance(node.target, str)
            and node.target.endswith("_")
            and node.args[:1] == (target,)
        )
    for i, name in compat.written_arguments(node.target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if target in values:
            return True
    return False


def _is_view(node: Node) -> bool:
    return node.op == "call_function" and compat.is_view_op(node.target)


def _escaping_view(window: Iterable[Node], target: Node, output: Node) -> Node | None:
    """A view of ``target`` made in the window (directly or through other views)
    that the graph returns, if any."""
    frontier = [n for n in window if _is_view(n) and n.args[:1] == (target,)]
    seen: set[Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if output in node.users:
            return node
        frontier.extend(u for u in node.users if _is_view(u) and u.args[:1] == (node,))
    return None


def _same_metadata(dst: Node, src: object) -> str | None:
    if not isinstance(src, Node):
        return "the source is not a node of the graph"
    d, s = example_value(dst), example_value(src)
    if not isinstance(s, torch.Tensor) or not isinstance(d, torch.Tensor):
        return "the source is not a tensor"
    for field in ("shape", "dtype", "device"):
        if getattr(d, field) != getattr(s, field):
            return f"{field} {getattr(s, field)} of the source vs {getattr(d, field)}"
    if d.stride() != s.stride():
        return f"stride {s.stride()} of the source vs {d.stride()}"
    return None


def _reads_data(node: Node, output: Node) -> bool:
    """True if ``node`` reads its input's data: it is not a view, or a view that
    some non-view node (other than the graph's output) reads."""
    if not _is_view(node):
        return node is not output
    return any(_reads_data(u, output) for u in node.users)


@dataclasses.dataclass(frozen=True, slots=True)
class _Chain:
    """One ``resize up -> fill -> uses -> resize to 0`` window on an input;
    ``late`` are the uses after the resize to 0 that read freed storage."""

    up: Node
    fill: Node
    source: Node
    uses: tuple[Node, ...]
    down: Node
    late: tuple[Node, ...] = ()


def _chains(
    nodes: list[Node], target: Node, output: Node
) -> tuple[list[_Chain], Unsupported | None]:
    """Split the target's events into chains, or say why they do not split."""
    chains: list[_Chain] = []
    state = "idle"
    up = fill = None
    src: object = None
    uses: list[Node] = []
    after_down: list[Node] = []  # reads since the last chain's resize to 0

    def left(kind: ResizeRefusalKind, why: str) -> Unsupported:
        return Unsupported(kind, f"input {target.name!r}", why, "left in the graph; still correct")

    for node in nodes:
        if node is output:
            continue
        touches = target in node.all_input_nodes
        if is_resize(node) and node.args[0] is target:
            if resize_size(node) and state == "idle":
                _attach_late_reads(chains, after_down, output)
                state, up = "up", node
            elif not resize_size(node) and state == "filled":
                assert up is not None and fill is not None
                assert isinstance(src, Node)
                chains.append(_Chain(up, fill, src, tuple(uses), node))
                state, uses = "idle", []
            else:
                return [], left(
                    ResizeRefusalKind.UNPAIRED_RESIZES,
                    f"{node.name} breaks the (up, copy, down) order",
                )
        elif is_fill(node) and any(d is target for d, _ in fill_pairs(node)):
            if state != "up":
                return [], left(
                    ResizeRefusalKind.UNPAIRED_RESIZES, f"{node.name} fills outside a resize-up"
                )
            fill = node
            src = next(s for d, s in fill_pairs(node) if d is target)
            if (why := _same_metadata(target, src)) is not None:
                return [], left(ResizeRefusalKind.METADATA_MISMATCH, f"{node.name}: {why}")
            state = "filled"
        elif touches and _writes(node, target):
            return [], left(ResizeRefusalKind.OTHER_MUTATION, f"{node.name} mutates it")
        elif touches and state == "filled":
            uses.append(node)
        elif touches and state == "up":
            return [], left(
                ResizeRefusalKind.UNPAIRED_RESIZES, f"{node.name} reads it before the fill"
            )
        elif touches and chains:
            after_down.append(node)
    if state != "idle":
        return [], left(
            ResizeRefusalKind.UNPAIRED_RESIZES, "a resize-up is not matched by a resize to 0"
        )
    _attach_late_reads(chains, after_down, output)
    for chain in chains:
        if (view := _escaping_view(chain.uses + chain.late, target, output)) is not None:
            return [], left(
                ResizeRefusalKind.VIEW_ESCAPES,
                f"view {view.name!r} of it is returned; reading the source would keep the "
                "full buffer alive",
            )
    return chains, None


def _attach_late_reads(chains: list[_Chain], after_down: list[Node], output: Node) -> None:
    """Give the last chain the reads after its resize to 0 when one of them reads
    data (compiled autograd places a parameter's post-accumulate-grad hook, the
    free, right after its gradient, while the same backward still reads the
    parameter for another gradient; eager runs the hook after the whole node)."""
    if chains and any(_reads_data(n, output) for n in after_down):
        chains[-1] = dataclasses.replace(chains[-1], late=tuple(after_down))
    after_down.clear()


def _drop_fill(gm: GraphModule, fill: Node, target: Node) -> None:
    pairs = list(fill_pairs(fill))
    rest = [(d, s) for d, s in pairs if d is not target]
    if rest:
        fill.args = ([d for d, _ in rest], [s for _, s in rest], *fill.args[2:])
        return
    if fill.users:
        fill.replace_all_uses_with(target)
    gm.graph.erase_node(fill)


def remove_resize_copy_resize(gm: GraphModule) -> PassResult[GraphModule]:
    """Drop every ``resize up -> fill -> uses -> resize to 0`` chain on a graph input.

    Inputs whose chain cannot be removed soundly are left alone; the reason is
    in ``PassResult.left_alone``.

    >>> result = remove_resize_copy_resize(fw_gm)  # doctest: +SKIP
    >>> [str(c) for c in result.changes]  # doctest: +SKIP
    ["remove_resize_copy_resize: input 'primals_1': 1 chain(s), 2 use(s) read 'all_gather'"]
    """
    plan = plan_storage_resizes(gm)
    output = gm.graph.output_node()
    by_name = {n.name: n for n in gm.graph.nodes}
    changes: list[Change] = []
    left_alone: list[Unsupported] = []
    for info in plan.inputs:
        if info.case is not ResizeCase.UP_DOWN:
            continue
        target = by_name[info.name]
        chains, reason = _chains(list(gm.graph.nodes), target, output)
        if reason is not None:
            left_alone.append(reason)
            continue
        for chain in chains:
            for use in chain.uses + chain.late:
                use.replace_input_with(target, chain.source)
                use.meta["loom_pass"] = PASS
            _drop_fill(gm, chain.fill, target)
            gm.graph.erase_node(chain.up)
            gm.graph.erase_node(chain.down)
        reads = sum(len(c.uses) for c in chains)
        late = sum(len(c.late) for c in chains)
        sources = ", ".join(sorted({c.source.name for c in chains}))
        what = f"{len(chains)} chain(s), {reads} use(s) read {sources}"
        if late:
            what += f"; {late} read(s) after its resize to 0 (freed storage) read the source too"
        changes.append(Change(PASS, f"input {target.name!r}", what))
    if changes:
        finish_graph(gm)
        log.debug("%s: %s", PASS, "; ".join(str(c) for c in changes))
    for reason in left_alone:
        log.debug("%s: left alone %s", PASS, reason)
    return PassResult(gm, bool(changes), tuple(changes), tuple(left_alone))
