"""One model for every closure cell of a trace.

A pre-existing cell is identified by the identity of the *cell object* (found
through a function's ``__closure__``), never by its contents: two functions
sharing a cell share one :class:`Cell`, and another cell holding an equal value
is another :class:`Cell`. Cells created while tracing (``MAKE_CELL``) are new
objects of the side-effect log: their reads and writes are symbolic and cost
nothing unless they escape (captured by a function that escapes). Reads of a
pre-existing cell's original contents become guards; writes become side effects
replayed through ``cell.cell_contents = value``.

A tracer whose symbolic values become recorded values only when its trace ends
(the hook tracer: tensors get graph outputs, new containers their final
contents) *stages* its writes: the staged value is the cell's current contents
for every later read, and the tracer records the write with :meth:`CellModel.store`
when it records its other side effects, in program order.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from loom_sidefx import (
    CellContentsSource,
    Checkpoint,
    ClosureSource,
    FunctionClosureSource,
    Guard,
    GuardKind,
    Missing,
    MutationType,
    Ref,
    SideEffects,
    Source,
    Value,
    is_constant,
)

from ._refusals import CellRefusalKind, refuse

__all__ = ["Cell", "CellCheckpoint", "CellModel", "GuardPolicy", "default_guard_policy"]

log = logging.getLogger("torchloom.cells")

#: Decides how a read of a pre-existing cell's contents is guarded (None: no guard).
GuardPolicy = Callable[[object], GuardKind | None]


def default_guard_policy(value: object) -> GuardKind | None:
    """Value equality for constants, identity for every other object."""
    return GuardKind.EQUALS if is_constant(value) else GuardKind.IDENTITY


@dataclasses.dataclass(frozen=True, slots=True)
class CellCheckpoint:
    """A point to roll a :class:`CellModel` (and its side-effect log) back to."""

    side_effects: Checkpoint
    guards: tuple[Guard, ...]
    staged: tuple[tuple[Ref, object], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    """A modeled cell: its side-effect ref and the variable name it was first seen under."""

    ref: Ref
    name: str

    @property
    def mutation(self) -> MutationType:
        return self.ref.mutation

    @property
    def is_new(self) -> bool:
        return self.ref.is_new


class CellModel:
    """Registry of the cells one trace touches, on top of a :class:`SideEffects` log.

    Example (the hook ``def hook(x): nonlocal count; count += 1; return x``)::

        se = SideEffects()
        cells = CellModel(se)
        (count,) = cells.hook_closure(hook)          # pre-existing, ClosureSource(0, "count")
        n = concrete(cells.load(count))              # 3, guarded: count == 3
        cells.store(count, n + 1)                    # replayed: cell_contents = 4
        plan, guards = se.build(), cells.guards()
    """

    def __init__(
        self, side_effects: SideEffects, *, guard_policy: GuardPolicy | None = None
    ) -> None:
        self.side_effects = side_effects
        self.guard_policy = guard_policy or default_guard_policy
        self._cells: dict[Ref, Cell] = {}
        self._guards: dict[Guard, None] = {}
        # NOTE: staged contents are the caller's own symbolic values, not recorded values.
        self._staged: dict[Ref, object] = {}

    # ----------------------------------------------------------------- cells
    def existing(self, cell: types.CellType, source: Source | None, name: str = "") -> Cell:
        """The model of a pre-existing cell object (the same :class:`Cell` for the same object).

        ``source`` reaches the *cell* (e.g. ``ClosureSource(i, name)``).
        """
        if not isinstance(cell, types.CellType):
            self._refuse(CellRefusalKind.NOT_A_CELL, f"{type(cell).__qualname__} is not a cell")
        ref = self.side_effects.track_existing(cell, source)
        model = self._cells.get(ref)
        if model is None:
            model = self._cells[ref] = Cell(ref, name)
        return model

    def new_cell(self, name: str = "", contents: Value = Missing.ABSENT) -> Cell:
        """A cell created while tracing (``MAKE_CELL``), empty unless ``contents`` is given."""
        ref = self.side_effects.track_new_cell(contents)
        model = self._cells[ref] = Cell(ref, name)
        return model

    def hook_closure(self, fn: types.FunctionType) -> tuple[Cell, ...]:
        """The cells of the traced hook itself, sourced as ``closure[i:name]``."""
        return self._closure(fn, lambda i, name: ClosureSource(i, name))

    def closure_of(self, fn: types.FunctionType, fn_source: Source | None) -> tuple[Cell, ...]:
        """The cells of a pre-existing function the trace calls into.

        ``fn_source`` reaches the function (e.g. ``GlobalSource("helper")``); its
        cells are sourced as ``fn_source.__closure__[i:name]``. A cell already
        modeled (shared with the hook or another function) keeps its model.
        """
        if fn_source is None:
            return self._closure(fn, lambda i, name: None)
        return self._closure(fn, lambda i, name: FunctionClosureSource(fn_source, i, name))

    def cell_for(self, ref: Ref) -> Cell:
        """The model of a cell ref (e.g. from a new function's closure spec)."""
        cell = self._cells.get(ref)
        if cell is None:
            self._refuse(CellRefusalKind.NOT_A_CELL, f"{ref} is not a cell of this model")
        return cell

    # --------------------------------------------------------- reads, writes
    def load(self, cell: Cell, *, guard: bool = True) -> Value:
        """``LOAD_DEREF``: the cell's current contents.

        For a pre-existing cell not yet written by the trace this is an
        :class:`~loom_sidefx.Original` (or the Ref of an already tracked object,
        or the constant itself), and the read is guarded per the guard policy.
        With ``guard=False`` the tracer defers the guard (e.g. an int that is
        only used in replayed arithmetic) and calls :meth:`guard_read` if it
        later specializes on the value. A staged value (see :meth:`stage`) is
        returned as it was staged, with no guard.
        """
        if cell.ref in self._staged:
            return self._staged[cell.ref]
        value = self.side_effects.load_cell(cell.ref)
        if value is Missing.ABSENT:
            self._refuse(
                CellRefusalKind.EMPTY_CELL,
                f"free variable {cell.name!r} referenced before assignment",
                "assign the variable before the hook reads it",
            )
        if guard:
            self.guard_read(cell)
        return value

    def guard_read(self, cell: Cell, kind: GuardKind | None = None) -> Guard | None:
        """Guard the original contents of a pre-existing cell (``kind`` overrides the policy).

        Returns the guard, or None when none is needed: a new cell, a cell the
        trace already wrote (its value is symbolic), or a policy that says so.
        """
        if cell.is_new or cell.ref in self._staged or self.side_effects.is_mutated(cell.ref):
            return None
        return self._guard_original(cell, kind)

    def stage(self, cell: Cell, value: object) -> None:
        """``STORE_DEREF`` of a symbolic value the tracer records later.

        ``value`` is the tracer's own symbolic value: later reads of the cell
        (through any function sharing it) return it, unguarded. Nothing is
        recorded in the log: for a pre-existing cell the tracer calls
        :meth:`store` with the recorded value when it records its side effects
        (in program order); a new cell needs it only if the cell escapes.
        """
        self._require_source(cell, "write to")
        self._staged[cell.ref] = value

    def store(self, cell: Cell, value: Value) -> None:
        """``STORE_DEREF``: symbolic for a new cell, a replayed side effect for a pre-existing one.

        ``value`` is a recorded value; it replaces any staged one.
        """
        self._require_source(cell, "write to")
        self.side_effects.store_cell(cell.ref, value)
        self._staged.pop(cell.ref, None)

    def delete(self, cell: Cell) -> None:
        """``DELETE_DEREF``."""
        self._require_source(cell, "delete from")
        self.side_effects.del_cell(cell.ref)
        self._staged.pop(cell.ref, None)

    def new_function(
        self,
        code: types.CodeType,
        closure: tuple[Cell, ...],
        *,
        name: str | None = None,
        defaults: tuple[Value, ...] = (),
        kwdefaults: Mapping[str, Value] | None = None,
    ) -> Ref:
        """``MAKE_FUNCTION`` with a closure: a new function capturing these cells."""
        if len(closure) != len(code.co_freevars):
            self._refuse(
                CellRefusalKind.NOT_A_CELL,
                f"{code.co_name} has {len(code.co_freevars)} free variables, got {len(closure)} cells",
            )
        return self.side_effects.track_new_function(
            code,
            name or code.co_name,
            defaults=defaults,
            closure=tuple(c.ref for c in closure),
            kwdefaults=kwdefaults,
        )

    def checkpoint(self) -> CellCheckpoint:
        """Snapshot the cells, guards and the underlying side-effect log."""
        return CellCheckpoint(
            self.side_effects.checkpoint(), tuple(self._guards), tuple(self._staged.items())
        )

    def rollback(self, cp: CellCheckpoint) -> None:
        """Forget the cells, guards and side effects recorded since ``cp``."""
        self.side_effects.rollback(cp.side_effects)
        limit = cp.side_effects.num_entries
        self._cells = {ref: cell for ref, cell in self._cells.items() if ref.index < limit}
        self._guards = dict.fromkeys(cp.guards)
        self._staged = dict(cp.staged)

    def guards(self) -> tuple[Guard, ...]:
        """Guards on the pre-existing cell contents the trace read, in first-read order."""
        return tuple(self._guards)

    # --------------------------------------------------------------- helpers
    def _closure(
        self, fn: types.FunctionType, source: Callable[[int, str], Source | None]
    ) -> tuple[Cell, ...]:
        cells = fn.__closure__ or ()
        names = fn.__code__.co_freevars
        return tuple(
            self.existing(c, source(i, n), n)
            for i, (c, n) in enumerate(zip(cells, names, strict=True))
        )

    def _guard_original(self, cell: Cell, kind: GuardKind | None) -> Guard | None:
        src = self.side_effects.source_of(cell.ref)
        live: Any = self.side_effects.live_object(cell.ref)
        try:
            contents = live.cell_contents
        except ValueError:
            return None
        kind = kind or self.guard_policy(contents)
        if kind is None:
            return None
        if src is None:
            self._refuse(
                CellRefusalKind.NO_SOURCE,
                f"read of closure variable {cell.name!r} of a function with no source cannot be guarded",
                "pass the function to the hook, or reach it from a global",
            )
        if kind is GuardKind.TYPE:
            expected: Any = type(contents)
        elif kind is GuardKind.LENGTH:
            expected = len(contents)
        elif kind is GuardKind.DICT_KEYS:
            expected = tuple(contents)
        else:
            expected = contents
        guard = Guard(kind, CellContentsSource(src), expected)
        if guard not in self._guards:
            log.debug("guard %s", guard.describe())
            self._guards[guard] = None
        return guard

    def _require_source(self, cell: Cell, what: str) -> None:
        if not cell.is_new and self.side_effects.source_of(cell.ref) is None:
            self._refuse(
                CellRefusalKind.NO_SOURCE,
                f"{what} closure variable {cell.name!r} of a function with no source",
                "pass the function to the hook, or reach it from a global",
            )

    def _refuse(self, kind: CellRefusalKind, explanation: str, hint: str = "") -> NoReturn:
        refuse(self.side_effects.where, kind, explanation, hint)
