"""Typed refusals of the cell model.

Reads and writes of closure cells that cannot be guarded or replayed soundly
are refused with an :class:`Unsupported` value whose ``kind`` comes from
:class:`CellRefusal`, raised wrapped in :class:`CellRefused`. Every kind is
documented in ``docs/cells.md`` (a test keeps the two in sync).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NoReturn

__all__ = ["CellRefusal", "CellRefused", "Unsupported", "refuse"]


class CellRefusal(enum.Enum):
    """Why a cell operation is refused."""

    #: A pre-existing cell without a source was read with a guard wanted, or
    #: written: no guard or replay can reach it.
    NO_SOURCE = "no_source"
    #: An empty cell was read (CPython raises NameError "free variable ...
    #: referenced before assignment").
    EMPTY_CELL = "empty_cell"
    #: The frame has no cell variable or free variable of that name.
    UNKNOWN_NAME = "unknown_name"
    #: The object given as a cell is not a ``types.CellType`` / a closure of
    #: the wrong length was given for a code object.
    NOT_A_CELL = "not_a_cell"


@dataclasses.dataclass(frozen=True, slots=True)
class Unsupported:
    """What was refused, where (user file:line when known), why, and what to do."""

    kind: CellRefusal
    where: str
    explanation: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.explanation}" if self.where else self.explanation
        return f"{text} (hint: {self.hint})" if self.hint else text


class CellRefused(Exception):
    """Raised by :class:`~loom_cells.CellModel` methods; carries the typed reason."""

    def __init__(self, reason: Unsupported) -> None:
        super().__init__(str(reason))
        self.reason = reason


def refuse(where: str, kind: CellRefusal, explanation: str, hint: str = "") -> NoReturn:
    """Raise :class:`CellRefused` for ``kind``."""
    raise CellRefused(Unsupported(kind, where, explanation, hint))
