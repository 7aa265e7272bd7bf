"""Typed refusals of the cell model.

Reads and writes of closure cells that cannot be guarded or replayed soundly
are refused with an :class:`Unsupported` value (a ``loom_sidefx.Refusal``) whose ``kind`` comes from
:class:`CellRefusalKind`, raised wrapped in :class:`CellRefused`. Every kind is
documented in ``docs/cells.md`` (a test keeps the two in sync).
"""

from __future__ import annotations

import enum
from typing import NoReturn

from loom_sidefx import Refusal, RefusalError

__all__ = ["CellRefusalKind", "CellRefused", "Unsupported", "refuse"]


class CellRefusalKind(enum.Enum):
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


class Unsupported(Refusal[CellRefusalKind]):
    """A refusal of the cell model (the shared :class:`loom_sidefx.Refusal` base)."""

    __slots__ = ()


class CellRefused(RefusalError):
    """Raised by :class:`~loom_cells.CellModel` methods; carries the typed reason."""

    reason: Unsupported


def refuse(where: str, kind: CellRefusalKind, explanation: str, hint: str = "") -> NoReturn:
    """Raise :class:`CellRefused` for ``kind``."""
    raise CellRefused(Unsupported(kind, where, explanation, hint))
