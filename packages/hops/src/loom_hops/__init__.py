"""Hooks inside compiled graphs: a base class for higher-order operators that invoke
one subgraph and survive until codegen; saved-tensor hooks (traced with
``loom_tracer``, matched, then placed so that each pack runs right after a saved
tensor's last forward use and each unpack right before its first backward use);
backward hooks on intermediate tensors."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562): a backend asks every graph for its hook
# sites and pack/unpack operators, and only graphs that have some pay for the hook
# tracer, the operators' registration and the placement passes.
if TYPE_CHECKING:
    from loom_hops._grad_hook_inline import GradHookInlining, inline_grad_hooks
    from loom_hops._grad_hook_sites import grad_hook_sites
    from loom_hops._grad_hooks import bound_hook_count, grad_hook
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

_LAZY: dict[str, str] = {
    **dict.fromkeys(("GradHookInlining", "inline_grad_hooks"), "loom_hops._grad_hook_inline"),
    "grad_hook_sites": "loom_hops._grad_hook_sites",
    **dict.fromkeys(("bound_hook_count", "grad_hook"), "loom_hops._grad_hooks"),
    **dict.fromkeys(
        ("GraphModuleHooks", "HookGraphs", "LiftedInput", "PackedLayout", "TracedPack"),
        "loom_hops._hook_graphs",
    ),
    **dict.fromkeys(
        ("PackHookOp", "UnpackHookOp", "pack_hook_op", "unpack_hook_op"), "loom_hops._hook_hops"
    ),
    **dict.fromkeys(("HookDifference", "HookMismatch", "pair_mismatch"), "loom_hops._hook_match"),
    **dict.fromkeys(
        ("HookPair", "active_saved_tensors_hooks", "fingerprint_hooks"), "loom_hops._hook_pair"
    ),
    "inline_subgraph_hops": "loom_hops._inline",
    **dict.fromkeys(
        (
            "PackScope",
            "PackedTensor",
            "Placement",
            "SavedOrigin",
            "count_forward_outputs",
            "place_saved_tensor_hooks",
        ),
        "loom_hops._placement",
    ),
    **dict.fromkeys(
        (
            "eager_saved_tensors_hooks_disabled",
            "install_hooks_guard",
            "install_other_hooks_guard",
            "native_hook_inlining_disabled",
        ),
        "loom_hops._runtime",
    ),
    **dict.fromkeys(("PythonHookTracer", "prepare_saved_tensors_hooks"), "loom_hops._saved_hooks"),
    **dict.fromkeys(("SubgraphHOP", "subgraph_hops"), "loom_hops._subgraph_hop"),
    "order_intermediate_hooks": "loom_hops._tensor_hooks",
    **dict.fromkeys(("HopsRefusal", "HopsRefusalKind", "Unsupported"), "loom_hops._unsupported"),
}


# NOTE: type checkers see only the imports above, so an unknown name imported from
# this package is an error there, not an ``Any``.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


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
