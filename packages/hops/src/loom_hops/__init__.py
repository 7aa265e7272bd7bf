"""Hooks inside compiled graphs: a base class for higher-order operators that invoke
one subgraph and survive until codegen; saved-tensor hooks (traced with
``loom_tracer``, matched, then placed so that each pack runs right after a saved
tensor's last forward use and each unpack right before its first backward use);
backward hooks on intermediate tensors."""

from loom_hops._grad_hook_inline import GradHookInlining, inline_grad_hooks
from loom_hops._grad_hooks import bound_hook_count, grad_hook, grad_hook_sites
from loom_hops._hook_graphs import (
    GraphModuleHooks,
    HookGraphs,
    LiftedInput,
    PackedLayout,
    TracedPack,
)
from loom_hops._hook_hops import PackHookOp, UnpackHookOp, pack_hook_op, unpack_hook_op
from loom_hops._hook_match import HookDifference, HookMismatch, pair_mismatch
from loom_hops._hook_pair import HookPair, active_saved_tensors_hooks, fingerprint_hooks
from loom_hops._inline import inline_subgraph_hops
from loom_hops._placement import (
    PackedTensor,
    PackScope,
    Placement,
    SavedOrigin,
    count_forward_outputs,
    place_saved_tensor_hooks,
)
from loom_hops._runtime import (
    eager_saved_tensors_hooks_disabled,
    install_hooks_guard,
    install_other_hooks_guard,
    native_hook_inlining_disabled,
)
from loom_hops._saved_hooks import PythonHookTracer, prepare_saved_tensors_hooks
from loom_hops._subgraph_hop import SubgraphHOP, subgraph_hops
from loom_hops._tensor_hooks import order_intermediate_hooks
from loom_hops._unsupported import HopsRefusal, HopsRefusalKind, Unsupported

__version__ = "0.1.0"

__all__ = [
    "GradHookInlining",
    "GraphModuleHooks",
    "HookDifference",
    "HookGraphs",
    "HookMismatch",
    "HookPair",
    "HopsRefusal",
    "HopsRefusalKind",
    "LiftedInput",
    "PackHookOp",
    "PackScope",
    "PackedLayout",
    "PackedTensor",
    "Placement",
    "PythonHookTracer",
    "SavedOrigin",
    "SubgraphHOP",
    "TracedPack",
    "UnpackHookOp",
    "Unsupported",
    "__version__",
    "active_saved_tensors_hooks",
    "bound_hook_count",
    "count_forward_outputs",
    "eager_saved_tensors_hooks_disabled",
    "fingerprint_hooks",
    "grad_hook",
    "grad_hook_sites",
    "inline_grad_hooks",
    "inline_subgraph_hops",
    "install_hooks_guard",
    "install_other_hooks_guard",
    "native_hook_inlining_disabled",
    "order_intermediate_hooks",
    "pack_hook_op",
    "pair_mismatch",
    "place_saved_tensor_hooks",
    "prepare_saved_tensors_hooks",
    "subgraph_hops",
    "unpack_hook_op",
]
