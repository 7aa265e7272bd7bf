"""Refusals of ``loom_hops`` as typed data.

A function that cannot handle a hook or a graph returns (or raises, wrapped in
:class:`HopsRefusal`) an :class:`Unsupported` whose ``kind`` is one
:class:`HopsRefusalKind`. Every kind is described in ``docs/hops.md``; a test
keeps the two in sync. The umbrella turns a refusal into an eager fallback with
the reason in ``torchloom.report()``, or into an error in strict mode.
"""

from __future__ import annotations

import enum

from loom_sidefx import Refusal, RefusalError

__all__ = ["HopsRefusal", "HopsRefusalKind", "Unsupported"]


class HopsRefusalKind(enum.Enum):
    """Why ``loom_hops`` refused a hook or a graph."""

    #: A saved-tensor hook is a Python function and no tracer accepted it.
    HOOK_NOT_TRACEABLE = "hook_not_traceable"
    #: Only one of pack/unpack is a ``GraphModule``; the pair must be traced together.
    MIXED_HOOK_KINDS = "mixed_hook_kinds"
    #: Tracing a hook at a saved tensor's fake value failed.
    HOOK_TRACE_FAILED = "hook_trace_failed"
    #: The pack hook returned something that cannot cross from forward to backward.
    UNSUPPORTED_PACKED_VALUE = "unsupported_packed_value"
    #: The unpack hook did not return exactly one tensor.
    BAD_UNPACK_RESULT = "bad_unpack_result"
    #: The unpacked tensor's dtype, shape or device differs from the saved tensor's.
    UNPACK_MISMATCH = "unpack_mismatch"
    #: The forward/backward pair does not have the layout the placement expects.
    UNEXPECTED_GRAPH_LAYOUT = "unexpected_graph_layout"
    #: Compiled autograd is running: it owns saved tensors, so hooks stay eager.
    COMPILED_AUTOGRAD = "compiled_autograd"
    #: A traced Python hook has side effects that cannot be replayed after the graph.
    HOOK_SIDE_EFFECTS_UNSUPPORTED = "hook_side_effects_unsupported"


class Unsupported(Refusal[HopsRefusalKind]):
    """What was refused (``kind``), where, why, and what to do instead."""

    __slots__ = ()


class HopsRefusal(RefusalError, RuntimeError):
    """An :class:`Unsupported` raised through code that cannot return it."""

    reason: Unsupported
