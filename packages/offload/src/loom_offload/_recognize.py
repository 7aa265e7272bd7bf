"""Recognising an offload pair among placed saved-tensor hook graphs.

A pack graph offloads when it returns exactly one tensor that holds the saved
tensor's values on the host, and its unpack graph returns that tensor's values
on the saved tensor's device: the graphs are made only of copies, fresh buffers
and views that change neither dtype nor shape (``save_on_cpu``'s
``empty(pin_memory=True)`` + ``copy_``, ``.cpu()``, ``.to("cpu")``, ``clone``, a
stream pair whose stream operations the tracer dropped). Anything else (a cast, a
quantisation, a value the hook reads at each call) is not an offload, and the
pair's own graphs stay in place.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["why_not_offload_pack", "why_not_offload_unpack"]

_aten = torch.ops.aten
_prims = torch.ops.prims

#: Value-preserving ops an offload pair is made of (dtype and shape are checked apart).
_MOVES = frozenset(
    {
        _aten._to_copy.default,
        _aten.copy.default,
        _aten.copy_.default,
        _aten.clone.default,
        _aten.detach.default,
        _aten.alias.default,
        _aten.lift_fresh_copy.default,
        _aten._pin_memory.default,
        _prims.device_put.default,
        # Inductor's decomposition of ``_to_copy``: a cast to the same dtype (checked)
        _prims.convert_element_type.default,
    }
)
_FRESH = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)


def _why_not_moves(gm: torch.fx.GraphModule, like: torch.Tensor) -> tuple[str | None, object]:
    """Why ``gm`` is not a pure copy of its one input (``None``: it is), and its output's value."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return f"takes {len(placeholders)} inputs (values read at each call)", None
    outs = gm.graph.output_node().args[0]
    leaves = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if len(leaves) != 1 or not isinstance(leaves[0], torch.fx.Node):
        return f"returns {len(leaves)} values", None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function" or (node.target not in _MOVES and node.target not in _FRESH):
            return f"computes {node.target}", None
        if node.target in _FRESH and node.kwargs.get("layout", torch.strided) != torch.strided:
            return f"makes a {node.kwargs['layout']} buffer", None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != like.dtype:
            return f"{node.target} changes the dtype", None
    out = leaves[0].meta.get("val")
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        return "its result has another shape", None
    if placeholders[0] not in _ancestors(leaves[0]):
        return "its result does not read the saved tensor", None
    return None, out


def why_not_offload_pack(pack: torch.fx.GraphModule, saved: torch.Tensor) -> str | None:
    """Why ``pack`` (a placed pack graph) is not an offload of ``saved`` (``None``: it is)."""
    if saved.device.type == "cpu":
        return "the saved tensor is on the host already"
    why, out = _why_not_moves(pack, saved)
    if why is not None:
        return f"the pack {why}"
    assert isinstance(out, torch.Tensor)
    if out.device.type != "cpu":
        return f"the pack keeps it on {out.device}"
    return None


def why_not_offload_unpack(unpack: torch.fx.GraphModule, saved: torch.Tensor) -> str | None:
    """Why ``unpack`` does not bring ``saved`` back from the host (``None``: it does)."""
    why, out = _why_not_moves(unpack, saved)
    if why is not None:
        return f"the unpack {why}"
    assert isinstance(out, torch.Tensor)
    if out.device != saved.device:
        return f"the unpack returns it on {out.device}, not {saved.device}"
    return None


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(current.all_input_nodes)
    return seen
