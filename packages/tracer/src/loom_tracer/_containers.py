"""Methods of lists, dicts and sets (base-class behaviour; overrides are inlined before).

Each method is one operation of the trace's ``loom_sidefx`` log on the
container's ``ref``: the log updates the symbolic contents and records a
mutation of a pre-existing container; appends to a list whose contents were
never read do not read (or guard) the list.
"""

from __future__ import annotations

from typing import Any

from loom_sidefx import Staged

from ._constants import python_op, python_value
from ._context import TraceContext
from ._refusal import TraceRefusalKind, refuse
from ._values import ConstV, DictV, IteratorV, ListV, SetV, TupleV, Value


def list_extend(ctx: TraceContext, lst: ListV, other: Value) -> None:
    items = ctx.sequence_items(other)
    with ctx.log() as se:
        for item in items:
            se.list_append(lst.ref, Staged(item))


def list_append(ctx: TraceContext, lst: ListV, item: Value) -> None:
    with ctx.log() as se:
        se.list_append(lst.ref, Staged(item))


def call_list_method(ctx: TraceContext, lst: ListV, name: str, args: list[Value]) -> Value:
    none = ConstV(None)
    if name == "append" and len(args) == 1:
        list_append(ctx, lst, args[0])
        return none
    if name == "extend" and len(args) == 1:
        list_extend(ctx, lst, args[0])
        return none
    items = ctx.list_items(lst)
    if name == "insert" and len(args) == 2:
        with ctx.log() as se:
            se.list_insert(lst.ref, ctx.specialize(args[0]), Staged(args[1]))
        return none
    if name == "pop" and len(args) <= 1:
        idx = ctx.specialize(args[0]) if args else -1
        if not items:
            raise refuse(TraceRefusalKind.HOOK_RAISES, "IndexError: pop from empty list")
        norm = python_op(lambda: range(len(items))[idx])
        with ctx.log() as se:
            se.list_delitem(lst.ref, norm)
        popped: Value = items[norm]
        return popped
    if name == "clear" and not args:
        with ctx.log() as se:
            se.list_clear(lst.ref)
        return none
    if name in ("index", "count", "__len__", "copy") and len(args) <= 1:
        if name == "__len__":
            return ConstV(len(items))
        if name == "copy":
            return ctx.new_list(items)
        plain = [python_value(ctx, x) for x in items]
        return ConstV(python_op(getattr(plain, name), *[python_value(ctx, a) for a in args]))
    raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"list.{name} with {len(args)} arguments")


def call_dict_method(ctx: TraceContext, d: DictV, name: str, args: list[Value]) -> Value:
    items = ctx.dict_items(d)
    if name == "get" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        return items.get(key, args[1] if len(args) == 2 else ConstV(None))
    if name in ("keys", "values", "items") and not args:
        if name == "keys":
            return ctx.new_list(ConstV(k) for k in items)
        if name == "values":
            return ctx.new_list(items.values())
        return ctx.new_list(TupleV((ConstV(k), v)) for k, v in items.items())
    if name == "setdefault" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        if key not in items:
            value = args[1] if len(args) == 2 else ConstV(None)
            set_item(ctx, d, key, value)
            return value
        return items[key]
    if name == "pop" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        if key not in items:
            if len(args) == 2:
                return args[1]
            raise refuse(TraceRefusalKind.HOOK_RAISES, f"KeyError: {key!r}")
        with ctx.log() as se:
            se.dict_delitem(d.ref, key)
        return items[key]
    if name == "update" and len(args) == 1:
        other = args[0]
        pairs: list[tuple[Any, Value]]
        if isinstance(other, DictV):
            pairs = list(ctx.dict_items(other).items())
        else:
            pairs = []
            for pair in ctx.sequence_items(other):
                k, v = ctx.sequence_items(pair)
                pairs.append((ctx.specialize(k), v))
        for k, v in pairs:
            set_item(ctx, d, k, v)
        return ConstV(None)
    if name == "clear" and not args:
        with ctx.log() as se:
            se.dict_clear(d.ref)
        return ConstV(None)
    if name == "copy" and not args:
        return ctx.new_dict(items.items())
    raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"dict.{name} with {len(args)} arguments")


def set_item(ctx: TraceContext, d: DictV, key: Any, value: Value) -> None:
    """``d[key] = value`` for a constant ``key``."""
    with ctx.log() as se:
        se.dict_setitem(d.ref, key, Staged(value))


def call_set_method(ctx: TraceContext, s: SetV, name: str, args: list[Value]) -> Value:
    items = ctx.set_items(s)
    if name in ("add", "discard") and len(args) == 1:
        value = ctx.specialize(args[0])
        python_op(getattr(items, name), value)
        with ctx.log() as se:
            (se.set_add if name == "add" else se.set_discard)(s.ref, value)
        return ConstV(None)
    if name == "clear" and not args:
        with ctx.log() as se:
            se.set_clear(s.ref)
        return ConstV(None)
    if name == "copy" and not args:
        return ctx.new_set(items)
    raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"set.{name} with {len(args)} arguments")


def iterate(ctx: TraceContext, v: Value) -> IteratorV:
    if isinstance(v, IteratorV):
        return v
    return IteratorV(ctx.sequence_items(v))
