"""Handlers: calls (positional, keyword, ``*args``/``**kwargs``) and function creation."""

from __future__ import annotations

import dataclasses
import dis
import types

from loom_cells import Cell

from ._calls import call_value
from ._frame import Frame, handles
from ._pyversion import (
    CALL_FUNCTION_EX_ALWAYS_HAS_KWARGS,
    CALL_KW_REPLACES_KW_NAMES,
    FUNCTION_ATTRIBUTES_SET_APART,
    NULL_FOLLOWS_CALLABLE,
)
from ._refusal import TraceRefusalKind, refuse
from ._values import NULL, CellRefV, ConstV, DictV, FunctionV, SuperV, TupleV, Value

# MAKE_FUNCTION's flag bits (3.11, 3.12); SET_FUNCTION_ATTRIBUTE's oparg (3.13).
_DEFAULTS = 0x01
_KWDEFAULTS = 0x02
_ANNOTATIONS = 0x04
_CLOSURE = 0x08


@handles("KW_NAMES", when=not CALL_KW_REPLACES_KW_NAMES)
def _kw_names(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.kw_names = tuple(frame.code.co_consts[inst.arg])


@handles("CALL")
def _call(frame: Frame, inst: dis.Instruction) -> None:
    kw_names, frame.kw_names = frame.kw_names, ()
    _call_with(frame, inst, kw_names)


@handles("CALL_KW", when=CALL_KW_REPLACES_KW_NAMES)
def _call_kw(frame: Frame, inst: dis.Instruction) -> None:
    names = frame.pop()
    assert isinstance(names, ConstV) and isinstance(names.value, tuple)
    _call_with(frame, inst, names.value)


def _call_with(frame: Frame, inst: dis.Instruction, kw_names: tuple[str, ...]) -> None:
    """CALL's stack: the callable and a NULL or ``self`` (in the order of this Python),
    then the arguments, the last ``len(kw_names)`` of them by keyword."""
    assert inst.arg is not None
    args = frame.popn(inst.arg)
    b = frame.pop()
    a = frame.pop()
    if NULL_FOLLOWS_CALLABLE:  # callable, then NULL or self
        fn, self_or_null = a, b
    else:  # NULL and the callable, or the method and self
        fn, self_or_null = (b, NULL) if a is NULL else (a, b)
    if self_or_null is not NULL:
        args = [self_or_null, *args]
    kwargs: dict[str, Value] = {}
    if kw_names:
        kwargs = dict(zip(kw_names, args[-len(kw_names) :], strict=True))
        args = args[: -len(kw_names)]
    frame.push(_dispatch(frame, fn, args, kwargs))


@handles("CALL_FUNCTION_EX")
def _call_function_ex(frame: Frame, inst: dis.Instruction) -> None:
    has_kwargs = CALL_FUNCTION_EX_ALWAYS_HAS_KWARGS or bool((inst.arg or 0) & 1)
    kwargs_v = frame.pop() if has_kwargs else None
    if kwargs_v is NULL:
        kwargs_v = None
    args_v = frame.pop()
    if NULL_FOLLOWS_CALLABLE:
        if frame.pop() is not NULL:
            raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "a bound call with *args")
        fn = frame.pop()
    else:
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
    code = frame.ctx.specialize(frame.pop())
    assert isinstance(code, types.CodeType)
    fn = FunctionV(code, frame.globals, code.co_name)
    if not FUNCTION_ATTRIBUTES_SET_APART:
        assert inst.arg is not None
        # The attributes lie on the stack in the reverse order of their flag bits.
        for flag in (_CLOSURE, _ANNOTATIONS, _KWDEFAULTS, _DEFAULTS):
            if inst.arg & flag:
                fn = _with_attribute(frame, fn, flag, frame.pop())
    frame.push(fn)


@handles("SET_FUNCTION_ATTRIBUTE", when=FUNCTION_ATTRIBUTES_SET_APART)
def _set_function_attribute(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    fn = frame.pop()
    assert isinstance(fn, FunctionV)
    frame.push(_with_attribute(frame, fn, inst.arg, frame.pop()))


def _with_attribute(frame: Frame, fn: FunctionV, flag: int, value: Value) -> FunctionV:
    """``fn`` with the attribute MAKE_FUNCTION's (or SET_FUNCTION_ATTRIBUTE's) ``flag`` names."""
    if flag == _CLOSURE:
        assert isinstance(value, TupleV)
        closure: tuple[Cell, ...] = tuple(c.cell for c in value.items if isinstance(c, CellRefV))
        return dataclasses.replace(fn, closure=closure)
    if flag == _KWDEFAULTS:
        assert isinstance(value, DictV)
        kwdefaults = {str(k): v for k, v in frame.ctx.dict_items(value).items()}
        return dataclasses.replace(fn, kwdefaults=kwdefaults)
    if flag == _DEFAULTS:
        return dataclasses.replace(fn, defaults=tuple(frame.ctx.sequence_items(value)))
    return fn  # annotations (and 3.14's __annotate__) change nothing a call does
