"""Handlers: locals, constants, globals, closure cells and attributes."""

from __future__ import annotations

import dis

from ._attributes import del_attr, get_attr, set_attr
from ._frame import Frame, handles
from ._pyversion import (
    FUSED_LOCAL_ACCESS,
    LOAD_ATTR_HAS_METHOD_BIT,
    LOAD_CLOSURE_IS_LOAD_FAST,
    NEW_LOADS_AND_HINTS,
    NULL_FOLLOWS_CALLABLE,
    PY311,
    PY312,
)
from ._refusal import TraceRefusalKind, refuse
from ._values import NULL, CellRefV, ConstV, SuperV, Value


def _const(value: object) -> Value:
    return ConstV(value)


@handles("NOP", "RESUME", "EXTENDED_ARG", "COPY_FREE_VARS", "CACHE")
def _nop(frame: Frame, inst: dis.Instruction) -> None:
    """Free variables are bound when the frame is created; these only matter to CPython."""


@handles("MAKE_CELL")
def _make_cell(frame: Frame, inst: dis.Instruction) -> None:
    """A new cell for a cell variable, holding the local's value (an argument) if it has one."""
    cell = frame.cells.make_cell(inst.argval)
    value = frame.locals.pop(inst.argval, None)
    if value is not None:
        frame.ctx.store_cell(cell, value)


@handles("PRECALL", when=PY311)
def _precall(frame: Frame, inst: dis.Instruction) -> None:
    """3.11 only: CALL does all the work."""


@handles("LOAD_CONST")
@handles("LOAD_SMALL_INT", when=NEW_LOADS_AND_HINTS)
def _load_const(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(_const(inst.argval))


def _push_local(frame: Frame, name: str) -> None:
    if LOAD_CLOSURE_IS_LOAD_FAST and name not in frame.locals and name in frame.cells:
        frame.push(CellRefV(frame.cells.cell(name)))
        return
    if name not in frame.locals:
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"UnboundLocalError: local {name!r} referenced before assignment",
        )
    frame.push(frame.locals[name])


@handles("LOAD_FAST")
@handles("LOAD_FAST_CHECK", when=PY312)
@handles("LOAD_FAST_BORROW", when=NEW_LOADS_AND_HINTS)
def _load_fast(frame: Frame, inst: dis.Instruction) -> None:
    _push_local(frame, inst.argval)


@handles("LOAD_FAST_LOAD_FAST", when=FUSED_LOCAL_ACCESS)
@handles("LOAD_FAST_BORROW_LOAD_FAST_BORROW", when=NEW_LOADS_AND_HINTS)
def _load_fast_load_fast(frame: Frame, inst: dis.Instruction) -> None:
    first, second = inst.argval
    _push_local(frame, first)
    _push_local(frame, second)


@handles("STORE_FAST_LOAD_FAST", when=FUSED_LOCAL_ACCESS)
def _store_fast_load_fast(frame: Frame, inst: dis.Instruction) -> None:
    stored, loaded = inst.argval
    _store_local(frame, stored, frame.pop())
    _push_local(frame, loaded)


@handles("STORE_FAST_STORE_FAST", when=FUSED_LOCAL_ACCESS)
def _store_fast_store_fast(frame: Frame, inst: dis.Instruction) -> None:
    first, second = inst.argval
    _store_local(frame, first, frame.pop())
    _store_local(frame, second, frame.pop())


@handles("LOAD_FAST_AND_CLEAR", when=PY312)
def _load_fast_and_clear(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    if name in frame.cell_names and name in frame.cells:
        # NOTE: 3.12 inlined comprehension with its own cell `name`: the slot
        # holds the outer cell, saved here and restored by STORE_FAST.
        saved = frame.cells.rebind(name, None)
        assert saved is not None
        frame.push(CellRefV(saved))
        return
    frame.push(frame.locals.pop(name, NULL))


@handles("STORE_FAST")
def _store_fast(frame: Frame, inst: dis.Instruction) -> None:
    _store_local(frame, inst.argval, frame.pop())


def _store_local(frame: Frame, name: str, value: Value) -> None:
    if name in frame.cell_names:
        # 3.12: a slot shared by a local and a comprehension's cell holds one or the other.
        frame.cells.rebind(name, value.cell if isinstance(value, CellRefV) else None)
        if isinstance(value, CellRefV):
            frame.locals.pop(name, None)
            return
    if value is NULL:
        frame.locals.pop(name, None)
    else:
        frame.locals[name] = value


@handles("DELETE_FAST")
def _delete_fast(frame: Frame, inst: dis.Instruction) -> None:
    frame.locals.pop(inst.argval, None)


@handles("LOAD_GLOBAL")
def _load_global(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    _push_callable(frame, frame.ctx.load_global(frame.globals, inst.argval), bool(inst.arg & 1))


def _push_callable(frame: Frame, value: Value, with_null: bool) -> None:
    """``value``, with the NULL a call expects beside it (below it until 3.12, above from 3.13)."""
    if with_null and not NULL_FOLLOWS_CALLABLE:
        frame.push(NULL)
    frame.push(value)
    if with_null and NULL_FOLLOWS_CALLABLE:
        frame.push(NULL)


@handles("STORE_GLOBAL")
def _store_global(frame: Frame, inst: dis.Instruction) -> None:
    frame.ctx.store_global(frame.globals, inst.argval, frame.pop())


@handles("DELETE_GLOBAL")
def _delete_global(frame: Frame, inst: dis.Instruction) -> None:
    frame.ctx.load_global(frame.globals, inst.argval)
    frame.ctx.store_global(frame.globals, inst.argval, None)


@handles("LOAD_DEREF")
def _load_deref(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.ctx.load_cell(frame.cells.cell(inst.argval)))


@handles("STORE_DEREF")
def _store_deref(frame: Frame, inst: dis.Instruction) -> None:
    frame.ctx.store_cell(frame.cells.cell(inst.argval), frame.pop())


@handles("DELETE_DEREF")
def _delete_deref(frame: Frame, inst: dis.Instruction) -> None:
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, f"del of closure variable {inst.argval!r}"
    )


@handles("LOAD_CLOSURE")
def _load_closure(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(CellRefV(frame.cells.cell(inst.argval)))


@handles("LOAD_ATTR")
def _load_attr(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    obj = frame.pop()
    attr = get_attr(frame.ctx, obj, inst.argval, frame.depth)
    _push_callable(frame, attr, LOAD_ATTR_HAS_METHOD_BIT and bool(inst.arg & 1))


@handles("LOAD_METHOD", when=PY311)
def _load_method(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    frame.push(NULL)
    frame.push(get_attr(frame.ctx, obj, inst.argval, frame.depth))


@handles("LOAD_SUPER_ATTR", when=PY312)
def _load_super_attr(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    self_v = frame.pop()
    cls_v = frame.pop()
    frame.pop()  # the global `super`
    if not isinstance(cls_v, ConstV) or not isinstance(cls_v.value, type):
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "super() with an unknown class")
    attr = get_attr(frame.ctx, SuperV(cls_v.value, self_v), inst.argval, frame.depth)
    _push_callable(frame, attr, bool(inst.arg & 1))


@handles("STORE_ATTR")
def _store_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    value = frame.pop()
    set_attr(frame.ctx, obj, inst.argval, value)


@handles("DELETE_ATTR")
def _delete_attr(frame: Frame, inst: dis.Instruction) -> None:
    del_attr(frame.ctx, frame.pop(), inst.argval)
