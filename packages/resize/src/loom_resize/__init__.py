"""FX passes that functionalize ``untyped_storage().resize_()`` on graph inputs
the way FSDP2 uses it, remove the ``resize_(full) -> copy_ -> resize_(0)``
chain, keep ``fsdp.copy_`` alias semantics, and refuse what cannot be
functionalized soundly.

Run :func:`rewrite_fills_as_fsdp_copy` on the Dynamo graph (before
AOTAutograd), then :func:`remove_resize_copy_resize` and
:func:`move_shrinks_after_last_use` on each AOTAutograd graph.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562): every graph is planned (which finds no
# resized input in almost all of them), and only a graph with resizes imports the passes.
if TYPE_CHECKING:
    from loom_resize._chains import remove_resize_copy_resize
    from loom_resize._errors import ResizeRefusalKind, ResizeRefused, Unsupported
    from loom_resize._fills import rewrite_fills_as_fsdp_copy
    from loom_resize._pattern import FillOp, FSDPPatternStack
    from loom_resize._plan import (
        InputResizes,
        ResizeCase,
        ResizePlan,
        plan_storage_resizes,
        record_input_storage,
    )
    from loom_resize._shrinks import move_shrinks_after_last_use

_LAZY: dict[str, str] = {
    "remove_resize_copy_resize": "loom_resize._chains",
    **dict.fromkeys(("ResizeRefusalKind", "ResizeRefused", "Unsupported"), "loom_resize._errors"),
    "rewrite_fills_as_fsdp_copy": "loom_resize._fills",
    **dict.fromkeys(("FSDPPatternStack", "FillOp"), "loom_resize._pattern"),
    **dict.fromkeys(
        (
            "InputResizes",
            "ResizeCase",
            "ResizePlan",
            "plan_storage_resizes",
            "record_input_storage",
        ),
        "loom_resize._plan",
    ),
    "move_shrinks_after_last_use": "loom_resize._shrinks",
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
    "FSDPPatternStack",
    "FillOp",
    "InputResizes",
    "ResizeCase",
    "ResizePlan",
    "ResizeRefusalKind",
    "ResizeRefused",
    "Unsupported",
    "__version__",
    "move_shrinks_after_last_use",
    "plan_storage_resizes",
    "record_input_storage",
    "remove_resize_copy_resize",
    "rewrite_fills_as_fsdp_copy",
]
