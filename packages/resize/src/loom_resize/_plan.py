"""The resize plan of a graph: for every graph input whose storage is resized,
its storage size on entry and on exit, the resizes and fills that touch it,
and which of the functionalizable cases it is.

Building the plan is where unsound resizes are refused: a resize of something
that is not a graph input, of a tensor subclass, one that neither starts nor
ends at zero bytes, or a resized-up input filled by a differentiable copy.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from loom_resize import _torch_compat as compat
from loom_resize._errors import ResizeRefusalKind, ResizeRefused, Unsupported
from loom_resize._nodes import (
    example_value,
    fill_pairs,
    input_position,
    is_fill,
    is_resize,
    location,
    needed_nbytes,
    resize_size,
    storage_nbytes,
)

__all__ = [
    "STORAGE_NBYTES",
    "InputResizes",
    "ResizeCase",
    "ResizePlan",
    "plan_storage_resizes",
    "record_input_storage",
]

#: Placeholder meta key: the input's storage size in bytes on entry, when known.
STORAGE_NBYTES = "loom_storage_nbytes"


class ResizeCase(enum.Enum):
    """The net effect of an input's resizes over the whole graph."""

    #: Starts full, ends with zero bytes: the resize must follow the input's last use.
    SHRINK = "shrink"
    #: Starts at zero, ends full: the resize and the fill are an input mutation.
    GROW = "grow"
    #: Starts and ends at zero: a net no-op; uses may read the fill's source.
    UP_DOWN = "up_down"
    #: Starts and ends full but is freed and refilled in between.
    DOWN_UP = "down_up"


@dataclasses.dataclass(frozen=True, slots=True)
class InputResizes:
    """The resizes of one graph input, in graph order."""

    name: str
    start_nbytes: int
    end_nbytes: int
    full_nbytes: int
    resizes: tuple[str, ...]
    fills: tuple[str, ...]
    #: Where the input sits in the graph's arguments: ``(i,)``, or ``(i, j)`` for
    #: item ``j`` of list argument ``i`` (compiled autograd's inputs).
    position: tuple[int, ...] = ()

    @property
    def case(self) -> ResizeCase:
        if self.start_nbytes and not self.end_nbytes:
            return ResizeCase.SHRINK
        if not self.start_nbytes and self.end_nbytes:
            return ResizeCase.GROW
        if not self.start_nbytes:
            return ResizeCase.UP_DOWN
        return ResizeCase.DOWN_UP

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.case.value} ({self.start_nbytes} -> {self.end_nbytes} bytes, "
            f"{len(self.resizes)} resizes, {len(self.fills)} fills)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ResizePlan:
    """Every resized input of a graph, in order of first resize."""

    inputs: tuple[InputResizes, ...]

    def get(self, name: str) -> InputResizes | None:
        return next((i for i in self.inputs if i.name == name), None)

    def __bool__(self) -> bool:
        return bool(self.inputs)


def _refuse(
    kind: ResizeRefusalKind, node: Node, explanation: str, hint: str, at: Node | None = None
) -> ResizeRefused:
    return ResizeRefused(Unsupported(kind, location(node, at), explanation, hint))


def _check_input(resize: Node) -> Node:
    target = resize.args[0]
    assert isinstance(target, Node)
    if input_position(target) is None:
        raise _refuse(
            ResizeRefusalKind.INTERMEDIATE,
            target,
            "its storage is resized, but it is a tensor computed in the graph; "
            "only graph inputs (parameters, buffers, arguments) can have their storage "
            "resize functionalized",
            "resize the parameter itself, or move the resize outside the compiled region",
            at=resize,
        )
    if compat.is_tensor_subclass(example_value(target)):
        raise _refuse(
            ResizeRefusalKind.TENSOR_SUBCLASS,
            target,
            f"is a tensor subclass ({type(example_value(target)).__name__}) whose storage "
            "is resized; the storage of a wrapper subclass is not the data its ops read",
            "resize the plain tensor inside the subclass (e.g. the local shard of a DTensor)",
            at=resize,
        )
    return target


def _walk_sizes(target: Node, resizes: list[Node]) -> tuple[int, int, int]:
    value = example_value(target)
    if not isinstance(value, torch.Tensor):
        raise _refuse(
            ResizeRefusalKind.INTERMEDIATE,
            target,
            "has no tensor example value, so the bytes it needs are unknown",
            "pass the tensor itself as a graph input",
        )
    full = needed_nbytes(value)
    start = target.meta.get(STORAGE_NBYTES)
    if start is None:
        # NOTE: fake values do not tell the storage size on entry (tracing resized
        # them), so without a recorded size it is read off the first resize: a
        # resize up means the input entered empty, a resize to 0 that it was full.
        start = 0 if resize_size(resizes[0]) else full
    current = start
    for node in resizes:
        new = resize_size(node)
        if new == current:
            continue
        if new == 0 or (current == 0 and new >= full):
            current = new
            continue
        raise _refuse(
            ResizeRefusalKind.PARTIAL_RESIZE,
            target,
            f"its storage is resized from {current} to {new} bytes; "
            f"only resizes from 0 to at least the {full} bytes the tensor needs, or to 0, "
            "can be functionalized",
            "resize to 0 bytes to free, and to numel() * element_size() to re-allocate",
            at=node,
        )
    return start, current, full


def _check_fill(node: Node, dst: Node, src: object, grad_enabled: bool) -> None:
    src_value = example_value(src)
    if grad_enabled and getattr(src_value, "requires_grad", False):
        raise _refuse(
            ResizeRefusalKind.DIFFERENTIABLE_FILL,
            dst,
            f"{node.name} fills it from a tensor that requires grad while grad "
            "mode is on, so autograd would have to differentiate through the fill",
            "fill under torch.no_grad(), as FSDP2 does",
            at=node,
        )


def plan_storage_resizes(gm: GraphModule) -> ResizePlan:
    """Find every resized input of ``gm`` and check that it can be functionalized.

    Raises :class:`~loom_resize.ResizeRefused` for what cannot. Grad mode is
    followed through Dynamo's ``_set_grad_enabled`` calls, starting enabled.

    >>> plan = plan_storage_resizes(gm)  # doctest: +SKIP
    >>> [str(i) for i in plan.inputs]  # doctest: +SKIP
    ["p: up_down (0 -> 0 bytes, 2 resizes, 1 fills)"]
    """
    resizes: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if is_resize(node):
            resizes.setdefault(_check_input(node), []).append(node)
    fills: dict[Node, list[Node]] = {target: [] for target in resizes}
    grad_enabled = True
    set_grad = compat.set_grad_enabled_target()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is set_grad:
            grad_enabled = bool(node.args[0])
        elif is_fill(node):
            for dst, src in fill_pairs(node):
                if dst in fills:
                    _check_fill(node, dst, src, grad_enabled)
                    fills[dst].append(node)
    inputs = []
    for target, nodes in resizes.items():
        start, end, full = _walk_sizes(target, nodes)
        inputs.append(
            InputResizes(
                target.name,
                start,
                end,
                full,
                tuple(n.name for n in nodes),
                tuple(dict.fromkeys(n.name for n in fills[target])),
                input_position(target) or (),
            )
        )
    return ResizePlan(tuple(inputs))


def record_input_storage(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record each tensor input's real storage size on its node.

    Call it on the Dynamo graph with the real example inputs the backend got,
    so the plan knows which inputs enter with zero storage. Items of a list
    argument (compiled autograd's inputs) are recorded on their ``getitem``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs, strict=False):
        size = storage_nbytes(value)
        if size is not None:
            node.meta[STORAGE_NBYTES] = size
        elif isinstance(value, (list, tuple)):
            for user in node.users:
                position = input_position(user)
                if position is not None and len(position) == 2 and position[1] < len(value):
                    item = storage_nbytes(value[position[1]])
                    if item is not None:
                        user.meta[STORAGE_NBYTES] = item
