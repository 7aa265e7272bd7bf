"""Handlers: arithmetic, unary operators, comparisons, identity and membership."""

from __future__ import annotations

import dis
import operator

from ._frame import Frame, handles
from ._operators import binary_op, compare, contains, get_item, is_same, truthy, unary
from ._pyversion import CONDITIONS_CONVERTED_TO_BOOL, PY311, SUBSCRIPT_IS_BINARY_OP
from ._values import ConstV

# 3.13: COMPARE_OP's oparg bit that asks for the result as a bool.
_COMPARE_TO_BOOL = 16


@handles("BINARY_OP")
def _binary_op(frame: Frame, inst: dis.Instruction) -> None:
    rhs = frame.pop()
    lhs = frame.pop()
    if SUBSCRIPT_IS_BINARY_OP and inst.argrepr == "[]":
        frame.push(get_item(frame.ctx, lhs, rhs))
    else:
        frame.push(binary_op(frame.ctx, inst.argrepr, lhs, rhs))


@handles("UNARY_NEGATIVE")
def _unary_negative(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(unary(frame.ctx, operator.neg, frame.pop()))


@handles("UNARY_INVERT")
def _unary_invert(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(unary(frame.ctx, operator.invert, frame.pop()))


@handles("UNARY_NOT")
def _unary_not(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ConstV(not truthy(frame.ctx, frame.pop())))


@handles("TO_BOOL", when=CONDITIONS_CONVERTED_TO_BOOL)
def _to_bool(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ConstV(truthy(frame.ctx, frame.pop())))


def unary_positive(frame: Frame) -> None:
    frame.push(unary(frame.ctx, operator.pos, frame.pop()))


@handles("UNARY_POSITIVE", when=PY311)
def _unary_positive(frame: Frame, inst: dis.Instruction) -> None:
    unary_positive(frame)


@handles("COMPARE_OP")
def _compare_op(frame: Frame, inst: dis.Instruction) -> None:
    rhs = frame.pop()
    lhs = frame.pop()
    result = compare(frame.ctx, str(inst.argval), lhs, rhs)
    assert inst.arg is not None
    if CONDITIONS_CONVERTED_TO_BOOL and inst.arg & _COMPARE_TO_BOOL:
        result = ConstV(truthy(frame.ctx, result))
    frame.push(result)


@handles("IS_OP")
def _is_op(frame: Frame, inst: dis.Instruction) -> None:
    rhs = frame.pop()
    lhs = frame.pop()
    frame.push(ConstV(is_same(frame.ctx, lhs, rhs) != bool(inst.arg)))


@handles("CONTAINS_OP")
def _contains_op(frame: Frame, inst: dis.Instruction) -> None:
    container = frame.pop()
    item = frame.pop()
    frame.push(ConstV(contains(frame.ctx, item, container) != bool(inst.arg)))
