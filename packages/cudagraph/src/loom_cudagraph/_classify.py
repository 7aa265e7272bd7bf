"""Whether one node of a post-AOT aten graph can run inside a CUDA graph.

:func:`classify_node` returns ``None`` for a capturable node or an
:class:`Unsupported` naming the reason. It reads only ``node.meta["val"]``
(fake tensors) and the call target, so it runs on CPU without a device.
Tensors on the ``meta`` device do no work and never block capture.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.fx

from loom_cudagraph._collectives import collective_refusal, is_collective
from loom_cudagraph._reasons import CudagraphRefusalKind, Unsupported
from loom_cudagraph._registry import op_name, registered_rule
from loom_cudagraph._torch_compat import (
    NO_ARGUMENT,
    OpOverload,
    free_unbacked_symbols,
    named_argument,
)
from loom_sidefx import user_frame

__all__ = ["classify_node", "first_use_source", "node_devices", "source_location", "touches_device"]

_COPY_OPS = frozenset(
    {
        "aten._to_copy.default",
        "aten.copy_.default",
        "aten.copy.default",
        "aten.to.device",
        "aten.to.dtype_layout",
        "prims.device_put.default",
        "aten._foreach_copy_.default",
    }
)


def source_location(node: torch.fx.Node) -> str:
    """The user's source line a node came from (``file:line in fn``, as
    :func:`loom_sidefx.user_frame` reads it), else ``node <name>``."""
    trace = node.meta.get("stack_trace")
    frame = user_frame(trace) if isinstance(trace, str) else None
    return f"node {node.name}" if frame is None else str(frame)


def first_use_source(node: torch.fx.Node) -> str:
    """The source line of ``node`` or, for a placeholder, of its first user that has one."""
    for user in (node, *node.users):
        where = source_location(user)
        if not where.startswith("node "):
            return where
    return source_location(node)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _vals(node: torch.fx.Node, skip: Collection[torch.fx.Node] = ()) -> Iterator[Any]:
    yield node.meta.get("val")
    for arg in node.all_input_nodes:
        if arg in skip:
            continue
        val = arg.meta.get("val")
        # NOTE: a 0-dim CPU constant (``get_attr``) has one value forever, so a
        # capture that bakes it in stays correct; a CPU scalar *input* would not.
        if arg.op == "get_attr" and isinstance(val, torch.Tensor) and val.dim() == 0:
            continue
        yield val


def node_devices(node: torch.fx.Node, skip: Collection[torch.fx.Node] = ()) -> set[torch.device]:
    """Devices of the tensors a node reads and writes, ``meta`` excluded (and the
    inputs in ``skip``)."""
    return {t.device for v in _vals(node, skip) for t in _tensors(v) if t.device.type != "meta"}


#: Schema arguments of the attention ops that carry dropout's random seed and offset.
_SEED_ARGUMENTS = ("philox_seed", "philox_offset")


def unread_seed_inputs(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The inputs an attention op passes as its dropout seed and offset
    (``philox_seed``, ``philox_offset``) when its ``dropout_p`` is the constant 0.

    NOTE: memory-efficient attention's forward returns its seed and offset as CPU
    int64 scalars, and its backward takes them back; the kernels read them only
    when dropout is on. With ``dropout_p == 0`` nothing reads them, so a capture
    that holds them freezes nothing: they do not make the op a CPU op.
    """
    dropout = named_argument(node.target, node.args, node.kwargs, "dropout_p")
    if dropout is NO_ARGUMENT or not isinstance(dropout, int | float) or dropout != 0:
        return set()
    found = set()
    for name in _SEED_ARGUMENTS:
        arg = named_argument(node.target, node.args, node.kwargs, name)
        if isinstance(arg, torch.fx.Node):
            found.add(arg)
    return found


def touches_device(node: torch.fx.Node, device: torch.device | None) -> bool:
    """Whether the node reads or writes a tensor on ``device`` (any CUDA device if ``None``)."""
    if device is None:
        return any(d.type == "cuda" for d in node_devices(node))
    return any(d == device or d.type == "cuda" for d in node_devices(node))


def _bool_index(node: torch.fx.Node) -> bool:
    name = op_name(node.target)
    if not name.startswith(("aten.index.", "aten.index_put", "aten._unsafe_index_put")):
        return False
    indices = node.args[1] if len(node.args) > 1 else ()
    for idx in indices if isinstance(indices, list | tuple) else ():
        if isinstance(idx, torch.fx.Node):
            for t in _tensors(idx.meta.get("val")):
                if t.dtype in (torch.bool, torch.uint8):
                    return True
    return False


def _mutates_placeholder_storage(node: torch.fx.Node) -> bool:
    if op_name(node.target) not in (
        "aten.set_.source_Storage",
        "aten.set_.source_Tensor",
        "aten.set_.source_Storage_storage_offset",
        "aten.set_.default",
    ):
        return False
    first = node.args[0] if node.args else None
    return isinstance(first, torch.fx.Node) and first.op == "placeholder"


def classify_node(
    node: torch.fx.Node, device: torch.device | None, *, capture_collectives: bool = True
) -> Unsupported | None:
    """``None`` when ``node`` can be captured on ``device``, else why not.

    ``device`` is the device whose work is captured (the graph's CUDA device;
    tests pass ``cpu`` to plan a host graph for :class:`HostCapturer`). A
    collective is captured when its process group uses NCCL and its wait is in
    the graph (``capture_collectives=False`` refuses every collective).

    >>> classify_node(nonzero_node, torch.device("cuda", 0)).kind  # doctest: +SKIP
    <CudagraphRefusalKind.DATA_DEPENDENT_SHAPE: 'data_dependent_shape'>
    """
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    name = op_name(node.target)
    where = source_location(node)

    def refuse(
        kind: CudagraphRefusalKind, explanation: str, hint: str = "", cuda_work: bool | None = None
    ) -> Unsupported:
        work = touches_device(node, device) if cuda_work is None else cuda_work
        return Unsupported(kind, where, explanation, hint, name, work)

    rule = registered_rule(node.target)
    if rule is None and is_collective(node.target):
        rule = collective_refusal(node, device, capture_collectives)
    if rule is not None:
        return refuse(rule.kind, rule.explanation, rule.hint)
    if isinstance(node.target, OpOverload):
        tags = node.target.tags
        # NOTE: aten.index.Tensor carries the tag for its boolean-mask form only; with
        # integer indices its output shape is static (checked by _bool_index below).
        if torch.Tag.dynamic_output_shape in tags and not name.startswith("aten.index."):
            return refuse(
                CudagraphRefusalKind.DATA_DEPENDENT_SHAPE,
                "its output shape depends on tensor data",
                "use a fixed-size variant (nonzero_static, masked_fill) where one exists",
            )
        if torch.Tag.data_dependent_output in tags:
            return refuse(CudagraphRefusalKind.SYNC_OP, "its host output depends on device data")
    unbacked = set().union(*(free_unbacked_symbols(v) for v in _vals(node) if v is not None))
    if unbacked:
        symbols = ", ".join(sorted(str(s) for s in unbacked))
        return refuse(
            CudagraphRefusalKind.DATA_DEPENDENT_SHAPE,
            f"it uses data-dependent sizes ({symbols})",
            "a replay would reuse the sizes seen at capture",
        )
    if _bool_index(node):
        return refuse(
            CudagraphRefusalKind.DATA_DEPENDENT_SHAPE,
            "boolean-mask indexing computes its size from the mask",
            "use torch.where or masked_fill",
        )
    if _mutates_placeholder_storage(node):
        return refuse(
            CudagraphRefusalKind.INPUT_STORAGE_MUTATION, "set_ swaps a graph input's storage"
        )
    target_type = device.type if device is not None else "cuda"
    devices = node_devices(node, unread_seed_inputs(node) if target_type != "cpu" else ())
    if devices and all(d.type == "cpu" for d in devices) and target_type != "cpu":
        return refuse(CudagraphRefusalKind.CPU_TENSOR, "runs on the CPU", cuda_work=False)
    if any(d.type == "cpu" for d in devices) and target_type != "cpu":
        if name in _COPY_OPS:
            return refuse(
                CudagraphRefusalKind.DEVICE_COPY,
                "copies between host and device",
                "move the copy out of the compiled region or keep the data on the device",
            )
        return refuse(
            CudagraphRefusalKind.CPU_TENSOR,
            "mixes CPU and device tensors (a CPU scalar would be frozen into the graph)",
            "create the tensor on the device",
        )
    if device is not None and any(d != device for d in devices):
        return refuse(
            CudagraphRefusalKind.OTHER_DEVICE,
            f"uses {', '.join(sorted(str(d) for d in devices))} in a graph on {device}",
            "compile one function per device",
        )
    for t in _tensors(node.meta.get("val")):
        if t.is_sparse:
            return refuse(CudagraphRefusalKind.SPARSE_TENSOR, "produces a sparse tensor")
    return None
