"""Typed refusals of the side-effect log.

A mutation that cannot be replayed soundly after the graph runs is refused with
an :class:`Unsupported` value whose ``kind`` comes from
:class:`SideEffectRefusal`; builder methods raise it wrapped in
:class:`SideEffectRefused` so a tracer can stop at the first refusal. Every kind
is documented in ``docs/sidefx.md`` (a test keeps the two in sync).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["SideEffectRefusal", "SideEffectRefused", "Unsupported"]


class SideEffectRefusal(enum.Enum):
    """Why a side effect cannot be recorded or replayed."""

    #: A pre-existing object without a source was mutated or stored: the
    #: replay plan has no way to reach it after the graph runs.
    NO_SOURCE = "no_source"
    #: A dict key or set element is not a hashable constant.
    UNSUPPORTED_KEY = "unsupported_key"
    #: A stored value is neither a constant, a tracked object, an original
    #: item, a tensor slot, nor a tuple of those.
    UNSUPPORTED_VALUE = "unsupported_value"
    #: The operation does not apply to the object's kind (a list operation on
    #: a dict, an attribute store on a cell, ...).
    WRONG_KIND = "wrong_kind"
    #: The attribute is managed by a data descriptor (a property or a custom
    #: ``__set__``/``__delete__``) or the object has no instance ``__dict__``:
    #: a raw store would run user code or fail.
    DESCRIPTOR_ATTR = "descriptor_attr"
    #: A new object of this class cannot be materialized without running user
    #: code (a C base other than ``object``, ``list``, ``dict`` or ``set``).
    UNMATERIALIZABLE = "unmaterializable"
    #: CPython would raise here (pop from an empty list, a missing key or
    #: attribute): the hook's behaviour is an exception, not a side effect.
    WOULD_RAISE = "would_raise"
    #: The value refers to a tracked object of another builder, or to an object
    #: the builder has never seen.
    FOREIGN_REF = "foreign_ref"


@dataclasses.dataclass(frozen=True, slots=True)
class Unsupported:
    """What was refused, where (user file:line when known), why, and what to do."""

    kind: SideEffectRefusal
    where: str
    explanation: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.explanation}" if self.where else self.explanation
        return f"{text} (hint: {self.hint})" if self.hint else text


class SideEffectRefused(Exception):
    """Raised by :class:`~loom_sidefx.SideEffects` methods; carries the typed reason."""

    def __init__(self, reason: Unsupported) -> None:
        super().__init__(str(reason))
        self.reason = reason
