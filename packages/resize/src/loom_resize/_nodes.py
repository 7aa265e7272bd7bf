"""How the passes read FX nodes: which node resizes storage, which one fills a
tensor, the example value and storage size behind a node, and a user-facing
location for messages.

The same predicates serve the Dynamo graph (torch IR) and AOTAutograd's aten
graphs, so each pass can run on either.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from loom_resize import _torch_compat as compat
from loom_sidefx import user_frame

__all__ = [
    "describe",
    "example_value",
    "fill_pairs",
    "finish_graph",
    "input_position",
    "is_fill",
    "is_resize",
    "location",
    "needed_nbytes",
    "resize_size",
    "storage_nbytes",
]


def input_position(node: Node) -> tuple[int, ...] | None:
    """Where a graph input sits in the graph's arguments, or None for a computed tensor.

    A placeholder is ``(i,)``; an item of a list placeholder (compiled
    autograd passes its inputs as one list) is ``(i, j)``.
    """
    if node.op == "placeholder":
        return (_placeholder_index(node),)
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], Node)
        and node.args[0].op == "placeholder"
        and isinstance(node.args[1], int)
    ):
        return (_placeholder_index(node.args[0]), node.args[1])
    return None


def _placeholder_index(node: Node) -> int:
    return [n for n in node.graph.nodes if n.op == "placeholder"].index(node)


def is_resize(node: Node) -> bool:
    return node.op == "call_function" and node.target in compat.RESIZE_TARGETS


def resize_size(node: Node) -> int:
    size = node.args[1] if len(node.args) > 1 else node.kwargs["new_size"]
    assert isinstance(size, (int, torch.SymInt)), size
    return int(size)


def _is_tensor_copy(node: Node) -> bool:
    if node.op == "call_method":
        return node.target == "copy_"
    return node.op == "call_function" and node.target in compat.TENSOR_COPY_TARGETS


def _is_foreach_copy(node: Node) -> bool:
    return node.op == "call_function" and node.target in compat.FOREACH_COPY_TARGETS


def _is_fsdp_copy(node: Node) -> bool:
    return node.op == "call_function" and node.target in compat.fsdp_copy_targets()


def is_fill(node: Node) -> bool:
    """``copy_``, ``_foreach_copy_`` or ``fsdp.copy_``: writes a whole tensor."""
    return _is_tensor_copy(node) or _is_foreach_copy(node) or _is_fsdp_copy(node)


def fill_pairs(node: Node) -> Iterator[tuple[Node, Any]]:
    """The (destination, source) pairs a fill node writes."""
    if _is_foreach_copy(node):
        dsts, srcs = node.args[0], node.args[1]
        assert isinstance(dsts, (list, tuple)) and isinstance(srcs, (list, tuple))
        for dst, src in zip(dsts, srcs, strict=True):
            assert isinstance(dst, Node)
            yield dst, src
    elif _is_tensor_copy(node) or _is_fsdp_copy(node):
        dst = node.args[0]
        assert isinstance(dst, Node)
        yield dst, node.args[1]


def example_value(node: Any) -> Any:
    """The fake value of a node (``example_value`` in Dynamo graphs, ``val`` after AOT)."""
    if not isinstance(node, Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def storage_nbytes(value: Any) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    return int(value.untyped_storage().nbytes())


def needed_nbytes(value: torch.Tensor) -> int:
    """Bytes the tensor's storage must hold for all its elements to be readable."""
    if value.numel() == 0:
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(value.shape, value.stride(), strict=True))
    return int((value.storage_offset() + extent) * value.element_size())


def finish_graph(gm: GraphModule) -> None:
    """Verify and regenerate a graph a pass changed."""
    gm.graph.lint()  # type: ignore[no-untyped-call]
    gm.recompile()


def describe(node: Node) -> str:
    """``input G['p'] ('g_p_')`` for a Dynamo graph input, ``input 'primals_1'``, or ``node 'mm'``."""
    if node.op != "placeholder":
        return f"node {node.name!r}"
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return f"input {name} ({node.name!r})" if isinstance(name, str) else f"input {node.name!r}"


def location(node: Node, at: Node | None = None) -> str:
    """``describe(node)`` plus the user's ``file:line in fn`` taken from ``at``
    (default: ``node``), as :func:`loom_sidefx.user_frame` reads it."""
    trace = (at or node).meta.get("stack_trace")
    frame = user_frame(str(trace)) if trace else None
    return describe(node) if frame is None else f"{describe(node)} at {frame}"
