"""A base class for higher-order operators that invoke one subgraph and survive until codegen; the hook tracer (a symbolic interpreter of CPython 3.11/3.12 bytecode turning a hook into an FX graph, a replay plan, guards and a fingerprint); the passes that place saved-tensor pack/unpack subgraphs where they save memory; backward hooks on intermediate tensors."""

from loom_hops._grad_hook_inline import GradHookInlining, inline_grad_hooks
from loom_hops._grad_hooks import bound_hook_count, grad_hook, grad_hook_sites
from loom_hops._hook_graphs import GraphModuleHooks, HookGraphs, PackedLayout, TracedPack
from loom_hops._hook_hops import PackHookOp, UnpackHookOp, pack_hook_op, unpack_hook_op
from loom_hops._hook_match import HookDifference, HookMismatch, pair_mismatch
from loom_hops._inline import inline_subgraph_hops
from loom_hops._pass_result import PassResult
from loom_hops._placement import (
    PackedTensor,
    PackScope,
    Placement,
    count_forward_outputs,
    place_saved_tensor_hooks,
)
from loom_hops._runtime import (
    eager_saved_tensors_hooks_disabled,
    install_hooks_guard,
    install_other_hooks_guard,
    native_hook_inlining_disabled,
)
from loom_hops._saved_hooks import (
    HookPair,
    PythonHookTracer,
    active_saved_tensors_hooks,
    fingerprint_hooks,
    prepare_saved_tensors_hooks,
)
from loom_hops._subgraph_hop import SubgraphHOP, subgraph_hops
from loom_hops._tensor_hooks import order_intermediate_hooks
from loom_hops._unsupported import HopsRefusal, HopsRefusalKind, Unsupported
from loom_hops.tracer import Guard as HookGuard
from loom_hops.tracer import GuardKind as HookGuardKind
from loom_hops.tracer import HookUnsupported, TracedHook, TraceRefusalKind, trace_hook

__version__ = "0.1.0"

__all__ = [
    "GradHookInlining",
    "GraphModuleHooks",
    "HookDifference",
    "HookGraphs",
    "HookGuard",
    "HookGuardKind",
    "HookMismatch",
    "HookPair",
    "HookUnsupported",
    "HopsRefusal",
    "HopsRefusalKind",
    "PackHookOp",
    "PackScope",
    "PackedLayout",
    "PackedTensor",
    "PassResult",
    "Placement",
    "PythonHookTracer",
    "SubgraphHOP",
    "TraceRefusalKind",
    "TracedHook",
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
    "trace_hook",
    "unpack_hook_op",
]
