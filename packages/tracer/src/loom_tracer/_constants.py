"""Python evaluated on trace-time constants.

An operation whose operands are all constants runs at trace time
(``python_op``); an exception there is the hook's own error and refuses the
trace. ``python_value`` gives the plain Python copy of a constant-like value
(a list, tuple, dict or set of constants included) that such an operation runs
on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._context import TraceContext
from ._refusal import TraceRefusalKind, refuse
from ._values import DictV, IteratorV, ListV, SetV, TupleV, Value


def python_op(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Evaluate an operation on constants; an exception is the hook's own error."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise refuse(TraceRefusalKind.HOOK_RAISES, f"{type(exc).__name__}: {exc}") from None


def python_value(ctx: TraceContext, v: Value) -> Any:
    """A plain Python copy of a constant-like value (containers of constants included)."""
    if isinstance(v, IteratorV):
        return iter([python_value(ctx, x) for x in ctx.sequence_items(v)])
    if isinstance(v, (ListV, TupleV)) and v.py_type in (list, tuple):
        items = [python_value(ctx, x) for x in ctx.sequence_items(v)]
        return items if isinstance(v, ListV) else tuple(items)
    if isinstance(v, DictV) and v.py_type is dict:
        return {k: python_value(ctx, x) for k, x in ctx.dict_items(v).items()}
    if isinstance(v, SetV) and v.py_type is set:
        return set(ctx.set_items(v))
    return ctx.specialize(v)
