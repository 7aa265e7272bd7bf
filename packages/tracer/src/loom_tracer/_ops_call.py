"""Handlers: calls (positional, keyword, ``*args``/``**kwargs``) and function creation."""

from __future__ import annotations

import dis
import types

from loom_cells import Cell

from ._calls import call_value
from ._frame import Frame, handles
from ._refusal import TraceRefusalKind, refuse
from ._values import NULL, CellRefV, ConstV, DictV, FunctionV, SuperV, TupleV, Value

_MAKE_FUNCTION_DEFAULTS = 0x01
_MAKE_FUNCTION_KWDEFAULTS = 0x02
_MAKE_FUNCTION_ANNOTATIONS = 0x04
_MAKE_FUNCTION_CLOSURE = 0x08


@handles("KW_NAMES")
def _kw_names(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.kw_names = tuple(frame.code.co_consts[inst.arg])


@handles("CALL")
def _call(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    args = frame.popn(inst.arg)
    b = frame.pop()
    a = frame.pop()
    if a is NULL:
        fn = b
    else:
        fn, args = a, [b, *args]
    kw_names, frame.kw_names = frame.kw_names, ()
    kwargs: dict[str, Value] = {}
    if kw_names:
        kwargs = dict(zip(kw_names, args[-len(kw_names) :], strict=True))
        args = args[: -len(kw_names)]
    frame.push(_dispatch(frame, fn, args, kwargs))


@handles("CALL_FUNCTION_EX")
def _call_function_ex(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    kwargs_v = frame.pop() if inst.arg & 1 else None
    args_v = frame.pop()
    fn = frame.pop()
    if frame.stack and frame.stack[-1] is NULL:
        frame.pop()
    args = frame.ctx.sequence_items(args_v)
    kwargs: dict[str, Value] = {}
    if kwargs_v is not None:
        if not isinstance(kwargs_v, DictV):
            raise refuse(TraceRefusalKind.UNSUPPORTED_VALUE, "** of a non-dict")
        kwargs = {str(k): v for k, v in frame.ctx.dict_items(kwargs_v).items()}
    frame.push(_dispatch(frame, fn, args, kwargs))


def _dispatch(frame: Frame, fn: Value, args: list[Value], kwargs: dict[str, Value]) -> Value:
    if isinstance(fn, ConstV) and fn.value is super and not args and not kwargs:
        return _zero_arg_super(frame)
    return call_value(frame.ctx, fn, args, kwargs, frame.depth)


def _zero_arg_super(frame: Frame) -> Value:
    if "__class__" not in frame.cells.names() or frame.code.co_argcount == 0:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "super() outside a method")
    cls_v = frame.ctx.load_cell(frame.cells.cell("__class__"))
    self_v = frame.locals.get(frame.code.co_varnames[0])
    if not isinstance(cls_v, ConstV) or not isinstance(cls_v.value, type) or self_v is None:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "super() with an unknown class")
    return SuperV(cls_v.value, self_v)


@handles("MAKE_FUNCTION")
def _make_function(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    code = frame.ctx.specialize(frame.pop())
    assert isinstance(code, types.CodeType)
    closure: tuple[Cell, ...] = ()
    defaults: tuple[Value, ...] = ()
    kwdefaults: dict[str, Value] = {}
    if inst.arg & _MAKE_FUNCTION_CLOSURE:
        cells = frame.pop()
        assert isinstance(cells, TupleV)
        closure = tuple(c.cell for c in cells.items if isinstance(c, CellRefV))
    if inst.arg & _MAKE_FUNCTION_ANNOTATIONS:
        frame.pop()
    if inst.arg & _MAKE_FUNCTION_KWDEFAULTS:
        kw = frame.pop()
        assert isinstance(kw, DictV)
        kwdefaults = {str(k): v for k, v in frame.ctx.dict_items(kw).items()}
    if inst.arg & _MAKE_FUNCTION_DEFAULTS:
        defaults = tuple(frame.ctx.sequence_items(frame.pop()))
    frame.push(FunctionV(code, frame.globals, code.co_name, closure, defaults, kwdefaults))
