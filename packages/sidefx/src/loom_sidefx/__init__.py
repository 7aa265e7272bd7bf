"""Symbolic values with a mutation type, the side-effect log of a traced hook, pruning of dead new objects, and the replay plan that applies recorded side effects, in program order, after a compiled graph runs; the refusal base every loom package shares, and the one reader of the user's source line a refusal points at (`user_frame`). Pure Python: it never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562): a package that needs only the refusal
# base, ``PassResult`` or ``user_frame`` does not load the side-effect machinery.
if TYPE_CHECKING:
    from ._builder import Checkpoint, SideEffects
    from ._guards import (
        Guard,
        GuardKind,
        GuardPredicate,
        SameElements,
        compile_guards,
        constant_guard,
    )
    from ._ops import FunctionSpec, NewObject, Op, OpKind, PreexistingObject
    from ._pass_result import Change, PassResult
    from ._refusals import (
        Refusal,
        RefusalError,
        SideEffectRefusalKind,
        SideEffectRefused,
        Unsupported,
    )
    from ._replay import PlanCheckError, ReplayPlan, checks_enabled
    from ._sources import (
        ArgSource,
        AttrSource,
        CellContentsSource,
        ClosureSource,
        FunctionClosureSource,
        GlobalSource,
        ItemSource,
        ObjectSource,
        Roots,
        Source,
    )
    from ._user_frame import UserFrame, user_frame
    from ._values import (
        COMPUTE_OPS,
        Computed,
        Missing,
        MutationType,
        ObjKind,
        Original,
        Ref,
        Staged,
        TensorSlot,
        Value,
        concrete,
        is_constant,
        register_constant_type,
    )

_LAZY: dict[str, str] = {
    **dict.fromkeys(("Checkpoint", "SideEffects"), "loom_sidefx._builder"),
    **dict.fromkeys(
        (
            "Guard",
            "GuardKind",
            "GuardPredicate",
            "SameElements",
            "compile_guards",
            "constant_guard",
        ),
        "loom_sidefx._guards",
    ),
    **dict.fromkeys(
        ("FunctionSpec", "NewObject", "Op", "OpKind", "PreexistingObject"), "loom_sidefx._ops"
    ),
    **dict.fromkeys(("Change", "PassResult"), "loom_sidefx._pass_result"),
    **dict.fromkeys(
        ("Refusal", "RefusalError", "SideEffectRefusalKind", "SideEffectRefused", "Unsupported"),
        "loom_sidefx._refusals",
    ),
    **dict.fromkeys(("PlanCheckError", "ReplayPlan", "checks_enabled"), "loom_sidefx._replay"),
    **dict.fromkeys(
        (
            "ArgSource",
            "AttrSource",
            "CellContentsSource",
            "ClosureSource",
            "FunctionClosureSource",
            "GlobalSource",
            "ItemSource",
            "ObjectSource",
            "Roots",
            "Source",
        ),
        "loom_sidefx._sources",
    ),
    **dict.fromkeys(("UserFrame", "user_frame"), "loom_sidefx._user_frame"),
    **dict.fromkeys(
        (
            "COMPUTE_OPS",
            "Computed",
            "Missing",
            "MutationType",
            "ObjKind",
            "Original",
            "Ref",
            "Staged",
            "TensorSlot",
            "Value",
            "concrete",
            "is_constant",
            "register_constant_type",
        ),
        "loom_sidefx._values",
    ),
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
    "COMPUTE_OPS",
    "ArgSource",
    "AttrSource",
    "CellContentsSource",
    "Change",
    "Checkpoint",
    "ClosureSource",
    "Computed",
    "FunctionClosureSource",
    "FunctionSpec",
    "GlobalSource",
    "Guard",
    "GuardKind",
    "GuardPredicate",
    "ItemSource",
    "Missing",
    "MutationType",
    "NewObject",
    "ObjKind",
    "ObjectSource",
    "Op",
    "OpKind",
    "Original",
    "PassResult",
    "PlanCheckError",
    "PreexistingObject",
    "Ref",
    "Refusal",
    "RefusalError",
    "ReplayPlan",
    "Roots",
    "SameElements",
    "SideEffectRefusalKind",
    "SideEffectRefused",
    "SideEffects",
    "Source",
    "Staged",
    "TensorSlot",
    "Unsupported",
    "UserFrame",
    "Value",
    "__version__",
    "checks_enabled",
    "compile_guards",
    "concrete",
    "constant_guard",
    "is_constant",
    "register_constant_type",
    "user_frame",
]
