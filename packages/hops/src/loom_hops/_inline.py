"""Inlining of :class:`SubgraphHOP` nodes: the last step before codegen.

Each ``op(subgraph, *operands)`` node is replaced by a copy of the subgraph's
nodes with its placeholders bound to the operands; the ``getitem`` users of the
node are rewired to the copied outputs. Afterwards the graph holds no
``SubgraphHOP`` and no subgraph module it registered, so any code generator
(Inductor, eager) sees plain aten ops.
"""

from __future__ import annotations

import logging
import operator
import sys
from typing import Any

import torch
import torch.fx

from loom_sidefx import PassResult

__all__ = ["inline_subgraph_hops"]

log = logging.getLogger("torchloom.hops")


def _copy_attr(gm: torch.fx.GraphModule, sub: torch.fx.GraphModule, target: str) -> str:
    value: Any = sub
    for part in target.split("."):
        value = getattr(value, part)
    base = f"_loom_inlined_{target.replace('.', '_')}"
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        gm.register_buffer(name, value)
    else:
        setattr(gm, name, value)
    return name


def _inline_one(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    graph = gm.graph
    sub_node, *operands = node.args
    if not (isinstance(sub_node, torch.fx.Node) and sub_node.op == "get_attr"):
        raise AssertionError(f"{node.name}: the subgraph operand must be a get_attr node")
    sub = getattr(gm, str(sub_node.target))
    if not isinstance(sub, torch.fx.GraphModule):
        raise AssertionError(f"{node.name}: {sub_node.target} is not a GraphModule")
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise AssertionError(
            f"{node.name}: subgraph takes {len(placeholders)} inputs, got {len(operands)}"
        )
    env.update(zip(placeholders, operands, strict=True))
    outputs: tuple[Any, ...] = ()
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                outputs = tuple(torch.fx.map_arg(sn.args[0], lambda n: env[n]))
                continue
            if sn.op == "get_attr":
                new = graph.get_attr(_copy_attr(gm, sub, str(sn.target)))
                new.meta = dict(sn.meta)
            else:
                new = graph.node_copy(sn, lambda n: env[n])
            new.meta.setdefault("loom_pass", "inline_subgraph_hops")
            env[sn] = new
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise AssertionError(f"{node.name}: only getitem may use a SubgraphHOP result")
        index = user.args[1]
        assert isinstance(index, int)
        user.replace_all_uses_with(outputs[index])
        graph.erase_node(user)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)
        target = str(sub_node.target)
        if "." not in target and hasattr(gm, target):
            delattr(gm, target)


def inline_subgraph_hops(gm: torch.fx.GraphModule) -> PassResult[torch.fx.GraphModule]:
    """Replace every :class:`SubgraphHOP` node in ``gm`` by its subgraph's body.

    >>> result = inline_subgraph_hops(fw_gm)   # right before Inductor / eager codegen
    >>> assert not any(isinstance(n.target, SubgraphHOP) for n in fw_gm.graph.nodes)
    """
    # NOTE: a SubgraphHOP exists only once loom_hops._subgraph_hop is imported (by the
    # saved-tensor hooks placement, or a user's own HOP): before that no graph can
    # call one, and the pass changes nothing without defining the operators.
    if "loom_hops._subgraph_hop" not in sys.modules:
        return PassResult(gm, False)
    from loom_hops._subgraph_hop import SubgraphHOP

    hops = [
        n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, SubgraphHOP)
    ]
    for node in hops:
        _inline_one(gm, node)
    if hops:
        gm.graph.lint()  # type: ignore[no-untyped-call]
        gm.recompile()
        log.debug("inline_subgraph_hops: inlined %d subgraph call(s)", len(hops))
    return PassResult(gm, bool(hops))
