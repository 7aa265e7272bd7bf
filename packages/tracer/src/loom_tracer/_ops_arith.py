"""Handlers: arithmetic, unary operators, comparisons, identity and membership."""

from __future__ import annotations

import dis
import operator

from ._frame import Frame, handles
from ._operators import binary_op, compare, contains, is_same, truthy, unary
from ._pyversion import PY311
from ._values import ConstV


@handles("BINARY_OP")
def _binary_op(frame: Frame, inst: dis.Instruction) -> None:
    rhs = frame.pop()
    lhs = frame.pop()
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


def unary_positive(frame: Frame) -> None:
    frame.push(unary(frame.ctx, operator.pos, frame.pop()))


@handles("UNARY_POSITIVE", when=PY311)
def _unary_positive(frame: Frame, inst: dis.Instruction) -> None:
    unary_positive(frame)


@handles("COMPARE_OP")
def _compare_op(frame: Frame, inst: dis.Instruction) -> None:
    rhs = frame.pop()
    lhs = frame.pop()
    frame.push(compare(frame.ctx, str(inst.argval), lhs, rhs))


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
