"""Typed refusals: the one refusal base of every loom package, and the side-effect log's kinds.

A refusal says what was refused (``kind``, a member of the refusing package's
own enum), where (the user's ``file:line`` when known), why, and what to do
instead. :class:`Refusal` is that value, generic in the kind enum; each package
subclasses it as its ``Unsupported`` (``class Unsupported(Refusal[CellRefusalKind])``)
and raises it wrapped in a subclass of :class:`RefusalError`. ``loom_sidefx``
is the root of the dependency table (stdlib only), so every package can share
the base. The log's own refusals use :class:`SideEffectRefusalKind`, every kind
documented in ``docs/sidefx.md`` (a test keeps the two in sync).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Generic, TypeVar

__all__ = [
    "Refusal",
    "RefusalError",
    "SideEffectRefusalKind",
    "SideEffectRefused",
    "Unsupported",
]

KindT = TypeVar("KindT", bound=enum.Enum)


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal(Generic[KindT]):
    """What was refused (``kind``), where (user file:line when known), why, and what to do.

    Example::

        class Unsupported(Refusal[CellRefusalKind]):
            __slots__ = ()

        str(Unsupported(CellRefusalKind.EMPTY_CELL, "hook.py:3", "x is empty", "assign x first"))
        # '[empty_cell] hook.py:3: x is empty (hint: assign x first)'
    """

    kind: KindT
    where: str
    explanation: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.explanation}" if self.where else self.explanation
        return f"[{self.kind.value}] {text}" + (f" (hint: {self.hint})" if self.hint else "")


class RefusalError(Exception):
    """An exception that carries a typed :class:`Refusal` (``.reason``) through code
    that cannot return it; each package raises its own subclass."""

    def __init__(self, reason: Refusal[Any]) -> None:
        super().__init__(str(reason))
        self.reason = reason


class SideEffectRefusalKind(enum.Enum):
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


class Unsupported(Refusal[SideEffectRefusalKind]):
    """A refusal of the side-effect log."""

    __slots__ = ()


class SideEffectRefused(RefusalError):
    """Raised by :class:`~loom_sidefx.SideEffects` methods; carries the typed reason."""

    reason: Unsupported
