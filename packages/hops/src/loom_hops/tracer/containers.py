"""Methods of lists, dicts and sets (base-class behaviour; overrides are inlined before).

Each mutating method updates the symbolic contents and logs one base-class
effect on a pre-existing container; appends to a list whose contents were
never read do not read (or guard) the list.
"""

from __future__ import annotations

from typing import Any

from loom_sidefx import OpKind

from .context import TraceContext
from .operators import python_op, python_value
from .refusal import TraceRefusal, refuse
from .values import ConstV, DictV, IteratorV, ListV, SetV, TupleV, Value


def list_extend(ctx: TraceContext, lst: ListV, other: Value) -> None:
    for item in ctx.sequence_items(other):
        list_append(ctx, lst, item)


def list_append(ctx: TraceContext, lst: ListV, item: Value) -> None:
    if lst.items is None:
        lst.tail.append(item)
    else:
        lst.items.append(item)
    ctx.effect(OpKind.LIST_APPEND, lst, None, item)


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
        idx = ctx.specialize(args[0])
        items.insert(idx, args[1])
        ctx.effect(OpKind.LIST_INSERT, lst, ConstV(idx), args[1])
        return none
    if name == "pop" and len(args) <= 1:
        idx = ctx.specialize(args[0]) if args else -1
        if not items:
            raise refuse(TraceRefusal.HOOK_RAISES, "IndexError: pop from empty list")
        norm = python_op(lambda: range(len(items))[idx])
        value = items.pop(norm)
        ctx.effect(OpKind.LIST_DELITEM, lst, ConstV(norm))
        return value
    if name == "clear" and not args:
        items.clear()
        ctx.effect(OpKind.LIST_CLEAR, lst)
        return none
    if name in ("index", "count", "__len__", "copy") and len(args) <= 1:
        if name == "__len__":
            return ConstV(len(items))
        if name == "copy":
            return ListV(None, None, items=list(items))
        plain = [python_value(ctx, x) for x in items]
        return ConstV(python_op(getattr(plain, name), *[python_value(ctx, a) for a in args]))
    raise refuse(TraceRefusal.UNSUPPORTED_CALL, f"list.{name} with {len(args)} arguments")


def call_dict_method(ctx: TraceContext, d: DictV, name: str, args: list[Value]) -> Value:
    items = ctx.dict_items(d)
    if name == "get" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        return items.get(key, args[1] if len(args) == 2 else ConstV(None))
    if name in ("keys", "values", "items") and not args:
        if name == "keys":
            return ListV(None, None, items=[ConstV(k) for k in items])
        if name == "values":
            return ListV(None, None, items=list(items.values()))
        return ListV(None, None, items=[TupleV((ConstV(k), v)) for k, v in items.items()])
    if name == "setdefault" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        if key not in items:
            value = args[1] if len(args) == 2 else ConstV(None)
            items[key] = value
            ctx.effect(OpKind.DICT_SETITEM, d, ConstV(key), value)
        return items[key]
    if name == "pop" and 1 <= len(args) <= 2:
        key = ctx.specialize(args[0])
        if key not in items:
            if len(args) == 2:
                return args[1]
            raise refuse(TraceRefusal.HOOK_RAISES, f"KeyError: {key!r}")
        value = items.pop(key)
        ctx.effect(OpKind.DICT_DELITEM, d, ConstV(key))
        return value
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
            items[k] = v
            ctx.effect(OpKind.DICT_SETITEM, d, ConstV(k), v)
        return ConstV(None)
    if name == "clear" and not args:
        items.clear()
        ctx.effect(OpKind.DICT_CLEAR, d)
        return ConstV(None)
    if name == "copy" and not args:
        return DictV(None, None, items=dict(items))
    raise refuse(TraceRefusal.UNSUPPORTED_CALL, f"dict.{name} with {len(args)} arguments")


def call_set_method(ctx: TraceContext, s: SetV, name: str, args: list[Value]) -> Value:
    items = ctx.set_items(s)
    if name in ("add", "discard") and len(args) == 1:
        value = ctx.specialize(args[0])
        python_op(getattr(items, name), value)
        ctx.effect(OpKind.SET_ADD if name == "add" else OpKind.SET_DISCARD, s, None, ConstV(value))
        return ConstV(None)
    if name == "clear" and not args:
        items.clear()
        ctx.effect(OpKind.SET_CLEAR, s)
        return ConstV(None)
    if name == "copy" and not args:
        return SetV(None, None, items=set(items))
    raise refuse(TraceRefusal.UNSUPPORTED_CALL, f"set.{name} with {len(args)} arguments")


def iterate(ctx: TraceContext, v: Value) -> IteratorV:
    if isinstance(v, IteratorV):
        return v
    return IteratorV(ctx.sequence_items(v))
