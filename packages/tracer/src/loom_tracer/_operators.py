"""Python operators on symbolic values: arithmetic, comparisons, identity, membership,
truthiness and subscripts.

On tensors an operator becomes a graph node; on constants it is evaluated at
trace time (an exception there means the hook itself would raise); on numbers
read from pre-existing state it stays symbolic (``LazyNum``) so that a counter
update needs no guard. Truthiness of a tensor is refused: that is control flow
on tensor values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from loom_sidefx import COMPUTE_OPS, Computed, Staged
from loom_sidefx import Value as Recorded

from ._constants import python_op, python_value
from ._containers import list_extend
from ._context import TraceContext, operand, slot
from ._refusal import TraceRefusalKind, refuse
from ._values import (
    ConstV,
    DictV,
    LazyNum,
    ListV,
    ObjectV,
    OrderingV,
    SetV,
    SymV,
    TensorV,
    TupleV,
    Value,
)

INPLACE_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.iadd,
    "-": operator.isub,
    "*": operator.imul,
    "/": operator.itruediv,
    "//": operator.ifloordiv,
    "%": operator.imod,
    "**": operator.ipow,
    "&": operator.iand,
    "|": operator.ior,
    "^": operator.ixor,
    "<<": operator.ilshift,
    ">>": operator.irshift,
    "@": operator.imatmul,
}
PLAIN_OPS: dict[str, Callable[[Any, Any], Any]] = {
    **{k: fn for k, fn in COMPUTE_OPS.items() if k not in ("min", "max")},
    "@": operator.matmul,
}
COMPARE_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
}


def _ref_of(v: Value) -> tuple[Recorded, tuple[Any, ...]]:
    if isinstance(v, LazyNum):
        return v.ref, v.leaves
    assert isinstance(v, ConstV)
    return v.value, ()


def binary_op(ctx: TraceContext, symbol: str, a: Value, b: Value) -> Value:
    """``a <symbol> b`` where ``symbol`` is BINARY_OP's text ("+", "+=", ...)."""
    inplace = symbol.endswith("=") and symbol not in ("==", "!=", "<=", ">=")
    base = symbol[:-1] if inplace else symbol
    if base not in PLAIN_OPS:
        raise refuse(TraceRefusalKind.UNSUPPORTED_OPCODE, f"binary operator {symbol!r}")
    if isinstance(a, TensorV) or isinstance(b, TensorV):
        fn = INPLACE_OPS[base] if inplace and isinstance(a, TensorV) else PLAIN_OPS[base]
        return ctx.call_torch(fn, [a, b], {})
    if isinstance(a, SymV) or isinstance(b, SymV):
        return ctx.call_torch(PLAIN_OPS[base], [a, b], {})
    if isinstance(a, ListV) and base == "+" and inplace:
        list_extend(ctx, a, b)
        return a
    if isinstance(a, (ListV, TupleV)) and base in ("+", "*"):
        return _sequence_op(ctx, base, a, b)
    numeric = (int, float)
    if (
        (isinstance(a, LazyNum) or isinstance(b, LazyNum))
        and isinstance(a, (LazyNum, ConstV))
        and isinstance(b, (LazyNum, ConstV))
        and base in COMPUTE_OPS
        and isinstance(_peek(a), numeric)
        and isinstance(_peek(b), numeric)
    ):
        value = python_op(COMPUTE_OPS[base], _peek(a), _peek(b))
        ra, la = _ref_of(a)
        rb, lb = _ref_of(b)
        return LazyNum(value, Computed(base, ra, rb), la + lb)
    x, y = operand(ctx, a), operand(ctx, b)
    return ConstV(python_op(PLAIN_OPS[base], x, y))


def _peek(v: Value) -> Any:
    return v.value if isinstance(v, (ConstV, LazyNum)) else None


def _sequence_op(ctx: TraceContext, base: str, a: ListV | TupleV, b: Value) -> Value:
    items_a = ctx.sequence_items(a)
    if base == "*":
        n = ctx.specialize(b)
        items = items_a * int(n)
    else:
        if type(b) is not type(a) and not (
            isinstance(a, TupleV) and isinstance(b, ConstV) and isinstance(b.value, tuple)
        ):
            raise refuse(
                TraceRefusalKind.HOOK_RAISES,
                f"TypeError: can only concatenate {a.py_type.__name__}",
            )
        items = items_a + ctx.sequence_items(b)
    if isinstance(a, TupleV):
        return TupleV(tuple(items))
    return ctx.new_list(items)


def compare(ctx: TraceContext, symbol: str, a: Value, b: Value) -> Value:
    for v in (a, b):
        ctx.require_base_protocol(v, "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")
    if isinstance(a, (TensorV, SymV)) or isinstance(b, (TensorV, SymV)):
        return ctx.call_torch(COMPARE_OPS[symbol], [a, b], {})
    x, y = (
        operand(ctx, v) if isinstance(v, (ConstV, LazyNum)) else python_value(ctx, v)
        for v in (a, b)
    )
    return ConstV(python_op(COMPARE_OPS[symbol], x, y))


def is_same(ctx: TraceContext, a: Value, b: Value) -> bool:
    """``a is b``: distinct values model distinct objects, except constants."""
    if a is b:
        return True
    if isinstance(a, OrderingV) and isinstance(b, OrderingV):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE,
            "identity of streams and events is not modelled (`is` between two of them)",
            "streams only order work in a trace; do not branch on which stream is current",
        )
    if isinstance(a, (ConstV, LazyNum)) and isinstance(b, (ConstV, LazyNum)):
        return bool(ctx.specialize(a) is ctx.specialize(b))
    return False


def contains(ctx: TraceContext, item: Value, container: Value) -> bool:
    ctx.require_base_protocol(container, "__contains__")
    if isinstance(container, TensorV) or isinstance(item, TensorV):
        raise refuse(TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW, "membership test on a tensor")
    if isinstance(container, DictV):
        return bool(python_op(operator.contains, ctx.dict_items(container), ctx.specialize(item)))
    if isinstance(container, SetV):
        return bool(python_op(operator.contains, ctx.set_items(container), ctx.specialize(item)))
    if isinstance(container, (ListV, TupleV)):
        needle = python_value(ctx, item)
        return any(
            (is_same(ctx, item, x) or python_value(ctx, x) == needle)
            for x in ctx.sequence_items(container)
        )
    return bool(python_op(operator.contains, ctx.specialize(container), python_value(ctx, item)))


def truthy(ctx: TraceContext, v: Value) -> bool:
    """``bool(v)`` for a branch."""
    if isinstance(v, TensorV):
        raise refuse(
            TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW,
            "a branch depends on a tensor's values",
            "branch on tensor metadata (dtype, shape, device) instead, or use torch.where",
        )
    if isinstance(v, (ConstV, LazyNum, SymV)):
        return bool(python_op(bool, ctx.specialize(v)))
    ctx.require_base_protocol(v, "__bool__", "__len__")
    if isinstance(v, (ListV, TupleV)):
        return bool(ctx.sequence_items(v))
    if isinstance(v, DictV):
        return bool(ctx.dict_items(v))
    if isinstance(v, SetV):
        return bool(ctx.set_items(v))
    if isinstance(v, ObjectV):
        cls = v.py_type
        if getattr(cls, "__bool__", None) is not None or getattr(cls, "__len__", None) is not None:
            raise refuse(TraceRefusalKind.UNSUPPORTED_VALUE, f"truth value of a {cls.__qualname__}")
    return True


def get_item(ctx: TraceContext, container: Value, index: Value) -> Value:
    ctx.require_base_protocol(container, "__getitem__")
    if isinstance(container, TensorV):
        return ctx.call_torch(operator.getitem, [container, index], {})
    if isinstance(container, DictV):
        key = ctx.specialize(index)
        items = ctx.dict_items(container)
        if key not in items:
            raise refuse(TraceRefusalKind.HOOK_RAISES, f"KeyError: {key!r}")
        return items[key]
    if isinstance(container, (ListV, TupleV)):
        idx = ctx.specialize(index)
        seq = ctx.sequence_items(container)
        picked = python_op(operator.getitem, seq, idx)
        if isinstance(idx, slice):
            if isinstance(container, TupleV):
                return TupleV(
                    tuple(picked), cls=torch.Size if container.cls is torch.Size else tuple
                )
            return ctx.new_list(picked)
        assert isinstance(picked, Value)
        return picked
    if isinstance(container, (ConstV, LazyNum)):
        return ConstV(
            python_op(operator.getitem, operand(ctx, container), python_value(ctx, index))
        )
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_VALUE, f"subscript of a {container.py_type.__qualname__}"
    )


def set_item(ctx: TraceContext, container: Value, index: Value, value: Value) -> None:
    if isinstance(container, TensorV):
        ctx.call_torch(operator.setitem, [container, index, value], {})
        return
    if isinstance(container, ListV) and slot(container.py_type, "__setitem__") is list.__setitem__:
        idx = ctx.specialize(index)
        if not isinstance(idx, int):
            raise refuse(TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, "slice assignment to a list")
        python_op(operator.setitem, ctx.list_items(container), idx, value)
        with ctx.log() as se:
            se.list_setitem(container.ref, idx, Staged(value))
        return
    if isinstance(container, DictV) and slot(container.py_type, "__setitem__") is dict.__setitem__:
        key = ctx.specialize(index)
        python_op(hash, key)
        with ctx.log() as se:
            se.dict_setitem(container.ref, key, Staged(value))
        return
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
        f"item assignment on a {container.py_type.__qualname__}",
    )


def del_item(ctx: TraceContext, container: Value, index: Value) -> None:
    if isinstance(container, ListV) and slot(container.py_type, "__delitem__") is list.__delitem__:
        idx = ctx.specialize(index)
        if not isinstance(idx, int):
            raise refuse(TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, "slice deletion from a list")
        python_op(operator.delitem, ctx.list_items(container), idx)
        with ctx.log() as se:
            se.list_delitem(container.ref, idx)
        return
    if isinstance(container, DictV) and slot(container.py_type, "__delitem__") is dict.__delitem__:
        key = ctx.specialize(index)
        python_op(operator.delitem, ctx.dict_items(container), key)
        with ctx.log() as se:
            se.dict_delitem(container.ref, key)
        return
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
        f"item deletion on a {container.py_type.__qualname__}",
    )


def unary(ctx: TraceContext, fn: Callable[[Any], Any], v: Value) -> Value:
    if isinstance(v, (TensorV, SymV)):
        return ctx.call_torch(fn, [v], {})
    return ConstV(python_op(fn, operand(ctx, v)))
