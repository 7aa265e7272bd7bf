"""Typed refusals of the resize passes.

Every reason a pass refuses a graph, or leaves one pattern alone, is an
:class:`Unsupported` value whose ``kind`` comes from :class:`ResizeRefusalKind`. A
refusal is raised as :class:`ResizeRefused`; a "left alone" reason is only
recorded in the pass report, since the graph stays correct without the pass.
"""

from __future__ import annotations

import enum

from loom_sidefx import Refusal, RefusalError

__all__ = ["ResizeRefusalKind", "ResizeRefused", "Unsupported"]


class ResizeRefusalKind(enum.Enum):
    """Why a storage resize was refused (R) or a pattern left alone (L)."""

    #: (R) A resize neither starts nor ends at zero bytes, or grows to fewer
    #: bytes than the tensor needs.
    PARTIAL_RESIZE = "partial_resize"
    #: (R) The resized input is a tensor subclass (e.g. a DTensor).
    TENSOR_SUBCLASS = "tensor_subclass"
    #: (R) The resized tensor is not a graph input.
    INTERMEDIATE = "intermediate"
    #: (R) A resized-up input is filled by a copy that autograd must differentiate.
    DIFFERENTIABLE_FILL = "differentiable_fill"
    #: (L) The copy's source differs from the input in shape, stride, dtype or device.
    METADATA_MISMATCH = "metadata_mismatch"
    #: (L) The input is mutated by something other than the resize/copy chain.
    OTHER_MUTATION = "other_mutation"
    #: (L) A view of the gathered input is returned (saved for backward), so
    #: reading the copy's source would keep the full buffer alive.
    VIEW_ESCAPES = "view_escapes"
    #: (L) The resizes of an input do not pair up as (resize up, copy, resize to 0).
    UNPAIRED_RESIZES = "unpaired_resizes"

    @property
    def is_refusal(self) -> bool:
        return self in _REFUSALS


_REFUSALS = frozenset(
    {
        ResizeRefusalKind.PARTIAL_RESIZE,
        ResizeRefusalKind.TENSOR_SUBCLASS,
        ResizeRefusalKind.INTERMEDIATE,
        ResizeRefusalKind.DIFFERENTIABLE_FILL,
    }
)


class Unsupported(Refusal[ResizeRefusalKind]):
    """What was refused (``kind``), where (graph input or node, with the user's
    file:line when known), why, and what to do instead."""

    __slots__ = ()


class ResizeRefused(RefusalError, RuntimeError):
    """A storage resize that cannot be functionalized soundly."""

    reason: Unsupported
