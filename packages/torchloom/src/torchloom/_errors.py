"""Refusals of the umbrella pipeline, as typed data.

A stage that cannot handle a graph raises :class:`LoomRefusal` carrying an
:class:`Unsupported`. The pipeline turns it into an eager fallback with a
logged reason, or re-raises it when the user asked for ``strict`` mode.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from loom_sidefx import Refusal, RefusalError

__all__ = ["LoomRefusal", "RefusalKind", "Unsupported"]


class RefusalKind(enum.Enum):
    """Why the umbrella pipeline refused a graph (listed in docs/unsupported.md)."""

    #: The graph has no tensor work: running it eagerly costs nothing.
    NO_TENSOR_WORK = "no_tensor_work"
    #: A package stage refused the graph (its own kind is in the message).
    STAGE_REFUSED = "stage_refused"
    #: AOTAutograd could not trace the graph.
    AOT_FAILED = "aot_failed"


@dataclasses.dataclass(frozen=True, slots=True)
class Unsupported(Refusal[RefusalKind]):
    """What was refused, where, why, and what to do instead.

    ``cause`` keeps the package's own refusal when a package refused (e.g. a
    ``loom_resize.Unsupported`` with its kind, where and hint), as typed data:
    every package's refusal is a :class:`loom_sidefx.Refusal`.
    """

    cause: Refusal[Any] | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        text = f"{self.where}: {self.explanation}" if self.where else self.explanation
        return f"{text} (hint: {self.hint})" if self.hint else text


class LoomRefusal(RefusalError, RuntimeError):
    """Raised by a stage to refuse a graph; carries the typed reason."""

    reason: Unsupported
