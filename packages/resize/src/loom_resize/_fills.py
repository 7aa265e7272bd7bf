"""Turn the fill of a resized graph input into ``fsdp.copy_``.

AOTAutograd 2.11 functionalizes ``copy_`` and ``_foreach_copy_``: it clones
the (zero-storage) input and copies into the clone, which crashes on the
empty storage in training graphs and loses the alias relation with the real
parameter. ``fsdp.copy_`` is an in-place copy AOTAutograd leaves in the graph,
so the fill writes the parameter's own storage, exactly as in eager: an alias
of the parameter kept by user code sees the new data. Runs on the Dynamo graph,
before AOTAutograd.
"""

from __future__ import annotations

import logging

from torch.fx import GraphModule, Node
from torch.fx.node import Argument

from loom_resize import _torch_compat as compat
from loom_resize._nodes import fill_pairs, finish_graph, is_fill
from loom_resize._plan import ResizePlan, plan_storage_resizes
from loom_sidefx import Change, PassResult

__all__ = ["rewrite_fills_as_fsdp_copy"]

log = logging.getLogger("torchloom.resize")
PASS = "rewrite_fills_as_fsdp_copy"


def _copy_node(gm: GraphModule, before: Node, dst: Node, src: Argument, origin: Node) -> Node:
    with gm.graph.inserting_before(before):
        new = gm.graph.call_function(compat.fsdp_copy(), (dst, src))
    new.meta.update(
        {k: v for k, v in origin.meta.items() if k in ("stack_trace", "nn_module_stack")}
    )
    new.meta["loom_pass"] = PASS
    return new


def rewrite_fills_as_fsdp_copy(
    gm: GraphModule, plan: ResizePlan | None = None
) -> PassResult[GraphModule]:
    """Rewrite ``copy_`` / ``_foreach_copy_`` into resized inputs as ``fsdp.copy_``.

    Refuses (raises :class:`~loom_resize.ResizeRefused`) what
    :func:`~loom_resize.plan_storage_resizes` refuses. In a ``_foreach_copy_``
    only the pairs whose destination is resized are split out. ``plan`` is the
    graph's plan when the caller made it already (it is made here otherwise).

    >>> result = rewrite_fills_as_fsdp_copy(dynamo_gm)  # doctest: +SKIP
    >>> result.changes[0].what  # doctest: +SKIP
    "copy_ -> fsdp.copy_ from 'l_src_'"
    """
    if plan is None:
        plan = plan_storage_resizes(gm)
    resized = {i.name for i in plan.inputs}
    fsdp_targets = compat.fsdp_copy_targets()
    changes: list[Change] = []
    for node in list(gm.graph.nodes):
        if not is_fill(node) or node.target in fsdp_targets:
            continue
        pairs = list(fill_pairs(node))
        ours = [(d, s) for d, s in pairs if d.name in resized]
        if not ours:
            continue
        if node.users and len(pairs) > 1:
            continue  # a foreach whose result list is read: leave it whole
        for dst, src in ours:
            _copy_node(gm, node, dst, src, node)
            src_name = src.name if isinstance(src, Node) else repr(src)
            changes.append(
                Change(PASS, f"input {dst.name!r}", f"{node.name} -> fsdp.copy_ from {src_name!r}")
            )
        rest = [(d, s) for d, s in pairs if d.name not in resized]
        if rest:
            node.args = ([d for d, _ in rest], [s for _, s in rest], *node.args[2:])
        else:
            if node.users:
                node.replace_all_uses_with(pairs[0][0])
            gm.graph.erase_node(node)
    if changes:
        finish_graph(gm)
        log.debug("%s: %s", PASS, "; ".join(str(c) for c in changes))
    return PassResult(gm, bool(changes), tuple(changes))
