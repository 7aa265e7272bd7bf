"""Typed refusals of the hook tracer.

A hook the tracer cannot model exactly is refused with a ``HookUnsupported`` value
that names the reason (a ``TraceRefusalKind`` kind), the place in the user's code
(``file.py:LINE``) and what to do instead. The tracer never guesses: anything
outside the modelled subset of Python ends here rather than in a wrong trace.
"""

from __future__ import annotations

import enum

from loom_sidefx import Refusal


class TraceRefusalKind(enum.Enum):
    """Why a hook was not traced (every member is documented in docs/tracer.md)."""

    UNSUPPORTED_PYTHON = "unsupported_python"
    UNSUPPORTED_OPCODE = "unsupported_opcode"
    UNSUPPORTED_CALL = "unsupported_call"
    UNSUPPORTED_VALUE = "unsupported_value"
    UNSUPPORTED_ATTRIBUTE = "unsupported_attribute"
    UNSUPPORTED_SIDE_EFFECT = "unsupported_side_effect"
    TENSOR_VALUE_CONTROL_FLOW = "tensor_value_control_flow"
    DATA_DEPENDENT_OP = "data_dependent_op"
    INPUT_MUTATION = "input_mutation"
    HOOK_RAISES = "hook_raises"
    INLINE_DEPTH = "inline_depth"
    ESCAPING_FUNCTION = "escaping_function"
    TORCH_ERROR = "torch_error"
    TRACER_ERROR = "tracer_error"


class HookUnsupported(Refusal[TraceRefusalKind]):
    """A hook the tracer refused: ``kind``, ``where`` (``file.py:LINE``), why, and what to do."""

    __slots__ = ()


class Refused(Exception):
    """Raised inside the tracer to unwind to ``trace_hook``, which returns ``.unsupported``."""

    def __init__(self, kind: TraceRefusalKind, explanation: str, hint: str = "") -> None:
        super().__init__(explanation)
        self.kind = kind
        self.explanation = explanation
        self.hint = hint
        # Filled by the innermost frame that sees the exception (the user's line).
        self.where: str | None = None

    def to_unsupported(self) -> HookUnsupported:
        return HookUnsupported(self.kind, self.where or "<unknown>", self.explanation, self.hint)


def refuse(kind: TraceRefusalKind, explanation: str, hint: str = "") -> Refused:
    """Build the exception to ``raise`` for a refusal (``raise refuse(...)``)."""
    return Refused(kind, explanation, hint)
