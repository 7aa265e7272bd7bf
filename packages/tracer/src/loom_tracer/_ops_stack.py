"""Handlers: stack manipulation, building and unpacking containers, subscripts, f-strings."""

from __future__ import annotations

import dis
from collections.abc import Callable
from typing import Any

from loom_sidefx import Staged

from ._constants import python_op, python_value
from ._containers import list_append
from ._containers import set_item as dict_set_item
from ._frame import Frame, handles
from ._operators import del_item, get_item, set_item
from ._ops_arith import unary_positive
from ._pyversion import (
    CONST_KEY_MAP_REMOVED,
    FORMAT_VALUE_SPLIT,
    PY311,
    PY312,
    SUBSCRIPT_IS_BINARY_OP,
)
from ._refusal import TraceRefusalKind, refuse
from ._values import NULL, ConstV, DictV, ListV, SetV, SliceV, SymV, TupleV, Value

_CONVERSIONS: dict[int, Callable[[Any], str]] = {1: str, 2: repr, 3: ascii}
# CPython's CALL_INTRINSIC_1 operands (Include/internal/pycore_intrinsics.h, 3.12).
_INTRINSIC_UNARY_POSITIVE = 5
_INTRINSIC_LIST_TO_TUPLE = 6


def make_slice(frame: Frame, parts: list[Value]) -> Value:
    """A constant slice, or a ``SliceV`` when a bound is a symbolic size."""
    if any(isinstance(p, SymV) for p in parts):
        return SliceV(tuple(parts))
    return ConstV(slice(*[frame.ctx.specialize(p) for p in parts]))


def _tuple_of(items: list[Value]) -> Value:
    if all(isinstance(x, ConstV) and x.source is None for x in items):
        return ConstV(tuple(x.value for x in items if isinstance(x, ConstV)))
    return TupleV(tuple(items))


@handles("POP_TOP")
def _pop_top(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()


@handles("PUSH_NULL")
def _push_null(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(NULL)


@handles("COPY")
def _copy(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.push(frame.stack[-inst.arg])


@handles("SWAP")
def _swap(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    s = frame.stack
    s[-1], s[-inst.arg] = s[-inst.arg], s[-1]


@handles("BUILD_TUPLE")
def _build_tuple(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.push(_tuple_of(frame.popn(inst.arg)))


@handles("BUILD_LIST")
def _build_list(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.push(frame.ctx.new_list(frame.popn(inst.arg)))


@handles("BUILD_SET")
def _build_set(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    items = [frame.ctx.specialize(x) for x in frame.popn(inst.arg)]
    frame.push(frame.ctx.new_set(python_op(dict.fromkeys, items)))


@handles("BUILD_MAP")
def _build_map(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    flat = frame.popn(2 * inst.arg)
    items = {frame.ctx.specialize(k): v for k, v in zip(flat[::2], flat[1::2], strict=True)}
    frame.push(frame.ctx.new_dict(items.items()))


@handles("BUILD_CONST_KEY_MAP", when=not CONST_KEY_MAP_REMOVED)
def _build_const_key_map(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    keys = frame.ctx.specialize(frame.pop())
    values = frame.popn(inst.arg)
    frame.push(frame.ctx.new_dict(dict(zip(keys, values, strict=True)).items()))


@handles("BUILD_STRING")
def _build_string(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    parts = [frame.ctx.specialize(x) for x in frame.popn(inst.arg)]
    frame.push(ConstV("".join(parts)))


@handles("BUILD_SLICE")
def _build_slice(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.push(make_slice(frame, frame.popn(inst.arg)))


@handles("FORMAT_VALUE", when=not FORMAT_VALUE_SPLIT)
def _format_value(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    spec = frame.ctx.specialize(frame.pop()) if inst.arg & 4 else ""
    _push_formatted(frame, frame.pop(), inst.arg & 3, spec)


@handles("CONVERT_VALUE", when=FORMAT_VALUE_SPLIT)
def _convert_value(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    value = python_value(frame.ctx, frame.pop())
    frame.push(ConstV(python_op(_CONVERSIONS[inst.arg], value)))


@handles("FORMAT_SIMPLE", when=FORMAT_VALUE_SPLIT)
def _format_simple(frame: Frame, inst: dis.Instruction) -> None:
    _push_formatted(frame, frame.pop(), 0, "")


@handles("FORMAT_WITH_SPEC", when=FORMAT_VALUE_SPLIT)
def _format_with_spec(frame: Frame, inst: dis.Instruction) -> None:
    spec = frame.ctx.specialize(frame.pop())
    _push_formatted(frame, frame.pop(), 0, spec)


def _push_formatted(frame: Frame, value_v: Value, conversion: int, spec: str) -> None:
    """``format(value, spec)``, after ``str``/``repr``/``ascii`` when ``conversion`` says so."""
    value = python_value(frame.ctx, value_v)
    if conversion:
        value = python_op(_CONVERSIONS[conversion], value)
    frame.push(ConstV(python_op(format, value, spec)))


@handles("LIST_APPEND")
def _list_append(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    value = frame.pop()
    target = frame.stack[-inst.arg]
    assert isinstance(target, ListV)
    list_append(frame.ctx, target, value)


@handles("LIST_EXTEND")
def _list_extend(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    items = frame.ctx.sequence_items(frame.pop())
    target = frame.stack[-inst.arg]
    assert isinstance(target, ListV)
    with frame.ctx.log() as se:
        se.list_extend(target.ref, [Staged(x) for x in items])


@handles("SET_ADD")
def _set_add(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    value = frame.ctx.specialize(frame.pop())
    python_op(hash, value)
    target = frame.stack[-inst.arg]
    assert isinstance(target, SetV)
    with frame.ctx.log() as se:
        se.set_add(target.ref, value)


@handles("SET_UPDATE")
def _set_update(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    items = [frame.ctx.specialize(x) for x in frame.ctx.sequence_items(frame.pop())]
    for x in items:
        python_op(hash, x)
    target = frame.stack[-inst.arg]
    assert isinstance(target, SetV)
    with frame.ctx.log() as se:
        se.set_update(target.ref, items)


@handles("MAP_ADD")
def _map_add(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    value = frame.pop()
    key = frame.ctx.specialize(frame.pop())
    target = frame.stack[-inst.arg]
    assert isinstance(target, DictV)
    python_op(hash, key)
    dict_set_item(frame.ctx, target, key, value)


@handles("DICT_UPDATE", "DICT_MERGE")
def _dict_update(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    other = frame.pop()
    target = frame.stack[-inst.arg]
    assert isinstance(target, DictV)
    if not isinstance(other, DictV):
        raise refuse(TraceRefusalKind.UNSUPPORTED_VALUE, f"** of a {other.py_type.__qualname__}")
    items = frame.ctx.dict_items(target)
    for k, v in frame.ctx.dict_items(other).items():
        if inst.opname == "DICT_MERGE" and k in items:
            raise refuse(
                TraceRefusalKind.HOOK_RAISES,
                f"TypeError: got multiple values for keyword argument {k!r}",
            )
        dict_set_item(frame.ctx, target, k, v)


@handles("LIST_TO_TUPLE", when=PY311)
def _list_to_tuple(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(_tuple_of(frame.ctx.sequence_items(frame.pop())))


@handles("CALL_INTRINSIC_1", when=PY312)
def _call_intrinsic_1(frame: Frame, inst: dis.Instruction) -> None:
    if inst.arg == _INTRINSIC_LIST_TO_TUPLE:
        frame.push(_tuple_of(frame.ctx.sequence_items(frame.pop())))
    elif inst.arg == _INTRINSIC_UNARY_POSITIVE:
        unary_positive(frame)
    else:
        raise refuse(TraceRefusalKind.UNSUPPORTED_OPCODE, f"CALL_INTRINSIC_1 {inst.argrepr}")


@handles("UNPACK_SEQUENCE")
def _unpack_sequence(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    items = frame.ctx.sequence_items(frame.pop())
    if len(items) != inst.arg:
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"ValueError: expected {inst.arg} values to unpack, got {len(items)}",
        )
    frame.stack.extend(reversed(items))


@handles("UNPACK_EX")
def _unpack_ex(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    before, after = inst.arg & 0xFF, inst.arg >> 8
    items = frame.ctx.sequence_items(frame.pop())
    if len(items) < before + after:
        raise refuse(TraceRefusalKind.HOOK_RAISES, "ValueError: not enough values to unpack")
    middle = frame.ctx.new_list(items[before : len(items) - after])
    out = [*items[:before], middle, *items[len(items) - after :]]
    frame.stack.extend(reversed(out))


@handles("BINARY_SUBSCR", when=not SUBSCRIPT_IS_BINARY_OP)
def _binary_subscr(frame: Frame, inst: dis.Instruction) -> None:
    index = frame.pop()
    container = frame.pop()
    frame.push(get_item(frame.ctx, container, index))


@handles("STORE_SUBSCR")
def _store_subscr(frame: Frame, inst: dis.Instruction) -> None:
    index = frame.pop()
    container = frame.pop()
    value = frame.pop()
    set_item(frame.ctx, container, index, value)


@handles("DELETE_SUBSCR")
def _delete_subscr(frame: Frame, inst: dis.Instruction) -> None:
    index = frame.pop()
    del_item(frame.ctx, frame.pop(), index)


@handles("BINARY_SLICE", when=PY312)
def _binary_slice(frame: Frame, inst: dis.Instruction) -> None:
    stop = frame.pop()
    start = frame.pop()
    container = frame.pop()
    frame.push(get_item(frame.ctx, container, make_slice(frame, [start, stop])))


@handles("STORE_SLICE", when=PY312)
def _store_slice(frame: Frame, inst: dis.Instruction) -> None:
    stop = frame.pop()
    start = frame.pop()
    container = frame.pop()
    value = frame.pop()
    set_item(frame.ctx, container, make_slice(frame, [start, stop]), value)
