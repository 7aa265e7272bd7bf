"""Why a graph is not cached: typed data, never a bare ``False``.

A :class:`CacheBypass` means the graph compiles normally but is neither
looked up nor stored, because some part of what determines its result has no
content-derived hash. ``torchloom.report()`` shows the reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheBypassKind(enum.Enum):
    """Every reason a graph is compiled without the cache."""

    OPAQUE_CALL = "opaque_call"
    """A call the tracer could not see into (``torch.fx.wrap``, an allowed-in-graph
    function, a non-graph submodule) whose node has no ``user_cache_hash``."""
    UNHASHABLE_CONSTANT = "unhashable_constant"
    """A constant argument or attribute of the graph has no content-derived hash."""
    UNHASHABLE_CLOSURE = "unhashable_closure"
    """A hook or custom-op implementation closes over or reads a value with no
    content-derived hash."""
    UNSERIALIZABLE_ARTIFACT = "unserializable_artifact"
    """The compiled artifact cannot be written (e.g. it holds a process-local object)."""
    DISABLED = "disabled"
    """The cache is turned off (``cache=False`` or ``TORCHLOOM_CACHE=0``)."""


@dataclass(frozen=True, slots=True)
class CacheBypass:
    """A graph the cache refuses, with where and why.

    ``where`` is the node (and the user's file:line when known); ``hint`` says
    how to make the graph cacheable.
    """

    kind: CacheBypassKind
    where: str
    explanation: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"cache bypassed ({self.kind.value}) at {self.where}: {self.explanation}"
        return f"{text}. {self.hint}" if self.hint else text
