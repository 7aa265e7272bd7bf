"""The cells one traced frame sees, by its own variable names.

A :class:`FrameCells` maps the names of one code object's cell variables
(``co_cellvars``, created by ``MAKE_CELL``) and free variables (``co_freevars``,
bound to the closure it was called with) to :class:`~loom_cells.Cell` models.
Invariant: names are resolved only in the frame's own table, never in an outer
frame's, so a nested function's local (or its own cell) that shadows an outer
cell's name never touches the outer cell.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence

from loom_sidefx import Missing, Ref, Value

from ._model import Cell, CellModel
from ._refusals import CellRefusalKind, refuse

__all__ = ["FrameCells"]


class FrameCells:
    """Cell variables and free variables of one traced frame.

    Example (tracer side, for ``def outer(): x = 1; def inner(): return x``)::

        frame = FrameCells(cells, outer.__code__, closure=())
        frame.make_cell("x")                    # MAKE_CELL x
        frame.store("x", 1)                     # STORE_DEREF x
        fn = frame.make_function(inner_code)    # LOAD_CLOSURE x; MAKE_FUNCTION
        inner = FrameCells(cells, inner_code, closure=frame.closure_for(inner_code))
        inner.load("x")                         # 1
    """

    def __init__(self, model: CellModel, code: types.CodeType, closure: Sequence[Cell]) -> None:
        if len(closure) != len(code.co_freevars):
            refuse(
                model.side_effects.where,
                CellRefusalKind.NOT_A_CELL,
                f"{code.co_name} has free variables {code.co_freevars}, got {len(closure)} cells",
            )
        self.model = model
        self.code = code
        self._cells: dict[str, Cell] = dict(zip(code.co_freevars, closure, strict=True))

    @classmethod
    def for_hook(cls, model: CellModel, fn: Callable[..., object]) -> FrameCells:
        """The root frame of the traced hook: free variables are its real closure cells.

        ``fn`` is a Python function (``def``, ``lambda``); anything else has no code
        and closure to model: ``TypeError`` naming it.
        """
        if not isinstance(fn, types.FunctionType):
            raise TypeError(
                f"FrameCells.for_hook: {fn!r} ({type(fn).__name__}) is not a Python "
                "function; pass the hook's own def or lambda (for a bound method, its "
                "__func__)"
            )
        return cls(model, fn.__code__, model.hook_closure(fn))

    @classmethod
    def for_new_function(cls, model: CellModel, fn: Ref) -> FrameCells:
        """The frame of a call to a function the trace created (its closure are modeled cells)."""
        spec = model.side_effects.function_spec(fn)
        return cls(model, spec.code, tuple(model.cell_for(r) for r in spec.closure))

    def make_cell(self, name: str, contents: Value = Missing.ABSENT) -> Cell:
        """``MAKE_CELL``: a new cell for ``name`` holding the local's current value (if any)."""
        cell = self.model.new_cell(name, contents)
        self._cells[name] = cell
        return cell

    def cell(self, name: str) -> Cell:
        """The cell bound to ``name`` in this frame (``LOAD_CLOSURE``)."""
        cell = self._cells.get(name)
        if cell is None:
            refuse(
                self.model.side_effects.where,
                CellRefusalKind.UNKNOWN_NAME,
                f"{self.code.co_name} has no cell or free variable {name!r} (yet)",
            )
        return cell

    def rebind(self, name: str, cell: Cell | None) -> Cell | None:
        """Bind ``name`` to ``cell`` (None unbinds); return the previous binding.

        3.12 inlined comprehensions save and restore a shadowed cell this way.
        """
        previous = self._cells.pop(name, None)
        if cell is not None:
            self._cells[name] = cell
        return previous

    def names(self) -> tuple[str, ...]:
        return tuple(self._cells)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is bound to a cell in this frame now."""
        return name in self._cells

    def load(self, name: str, *, guard: bool = True) -> Value:
        """``LOAD_DEREF name`` (see :meth:`CellModel.load` for ``guard``)."""
        return self.model.load(self.cell(name), guard=guard)

    def store(self, name: str, value: Value) -> None:
        """``STORE_DEREF name``."""
        self.model.store(self.cell(name), value)

    def stage(self, name: str, value: object) -> None:
        """``STORE_DEREF name`` of a tracer value recorded later (see :meth:`CellModel.stage`)."""
        self.model.stage(self.cell(name), value)

    def delete(self, name: str) -> None:
        """``DELETE_DEREF name``."""
        self.model.delete(self.cell(name))

    def closure_for(self, code: types.CodeType) -> tuple[Cell, ...]:
        """The cells a nested function built in this frame captures, by its free variable names."""
        return tuple(self.cell(name) for name in code.co_freevars)

    def make_function(
        self,
        code: types.CodeType,
        *,
        name: str | None = None,
        defaults: tuple[Value, ...] = (),
        kwdefaults: Mapping[str, Value] | None = None,
    ) -> Ref:
        """``MAKE_FUNCTION`` in this frame: a new function closing over this frame's cells."""
        return self.model.new_function(
            code, self.closure_for(code), name=name, defaults=defaults, kwdefaults=kwdefaults
        )
