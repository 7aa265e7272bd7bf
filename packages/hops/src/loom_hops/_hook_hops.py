"""The two operators that mark saved-tensor hook boundaries in compiled graphs.

``loom_saved_tensor_pack(pack_graph, saved, *sizes)`` sits in the forward right
after the saved tensor's last use and returns the packed leaves (tensors and
symbolic sizes) that cross to the backward. ``loom_saved_tensor_unpack(
unpack_graph, *packed)`` sits in the backward right before the first use and
returns the tensor to use there. Neither is differentiable: they act on values
autograd has already saved.
"""

from __future__ import annotations

from loom_hops._subgraph_hop import SubgraphHOP

__all__ = ["PackHookOp", "UnpackHookOp", "pack_hook_op", "unpack_hook_op"]


class PackHookOp(SubgraphHOP):
    """Applies a traced pack hook to one saved tensor, in the forward graph."""

    differentiable = False


class UnpackHookOp(SubgraphHOP):
    """Applies a traced unpack hook to one packed value, in the backward graph."""

    differentiable = False


pack_hook_op = PackHookOp("loom_saved_tensor_pack")
unpack_hook_op = UnpackHookOp("loom_saved_tensor_unpack")
