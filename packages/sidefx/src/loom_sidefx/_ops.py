"""The entries of a replay plan: mutations of pre-existing state, the new
objects that escape into it, and the pre-existing objects the plan reaches.

An :class:`Op` is one mutation in program order; its ``target`` is a
pre-existing :class:`~loom_sidefx.Ref` (``None`` for globals). A
:class:`NewObject` is a new object materialized with its final state. A
:class:`PreexistingObject` is fetched through its source before any op runs.
All are frozen and described as deterministic text.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ._sources import Source
from ._values import Computed, ObjKind, Original, Ref, TensorSlot, Value

__all__ = ["NewObject", "Op", "OpKind", "PreexistingObject"]


class OpKind(enum.Enum):
    """A mutation the replay plan applies; the value is the target kind it needs."""

    STORE_ATTR = "store_attr"
    DEL_ATTR = "del_attr"
    GENERIC_SETATTR = "generic_setattr"
    GENERIC_DELATTR = "generic_delattr"
    LIST_APPEND = "list_append"
    LIST_EXTEND = "list_extend"
    LIST_SETITEM = "list_setitem"
    LIST_DELITEM = "list_delitem"
    LIST_INSERT = "list_insert"
    LIST_POP = "list_pop"
    LIST_CLEAR = "list_clear"
    LIST_REVERSE = "list_reverse"
    DICT_SETITEM = "dict_setitem"
    DICT_DELITEM = "dict_delitem"
    DICT_CLEAR = "dict_clear"
    SET_ADD = "set_add"
    SET_DISCARD = "set_discard"
    SET_CLEAR = "set_clear"
    STORE_GLOBAL = "store_global"
    DEL_GLOBAL = "del_global"
    STORE_CELL = "store_cell"
    DEL_CELL = "del_cell"


#: Target kind each op needs (None: no target, i.e. globals; "any": attribute ops).
OP_TARGET: dict[OpKind, ObjKind | str | None] = {
    OpKind.STORE_ATTR: "any",
    OpKind.DEL_ATTR: "any",
    OpKind.GENERIC_SETATTR: "any",
    OpKind.GENERIC_DELATTR: "any",
    OpKind.LIST_APPEND: ObjKind.LIST,
    OpKind.LIST_EXTEND: ObjKind.LIST,
    OpKind.LIST_SETITEM: ObjKind.LIST,
    OpKind.LIST_DELITEM: ObjKind.LIST,
    OpKind.LIST_INSERT: ObjKind.LIST,
    OpKind.LIST_POP: ObjKind.LIST,
    OpKind.LIST_CLEAR: ObjKind.LIST,
    OpKind.LIST_REVERSE: ObjKind.LIST,
    OpKind.DICT_SETITEM: ObjKind.DICT,
    OpKind.DICT_DELITEM: ObjKind.DICT,
    OpKind.DICT_CLEAR: ObjKind.DICT,
    OpKind.SET_ADD: ObjKind.SET,
    OpKind.SET_DISCARD: ObjKind.SET,
    OpKind.SET_CLEAR: ObjKind.SET,
    OpKind.STORE_GLOBAL: None,
    OpKind.DEL_GLOBAL: None,
    OpKind.STORE_CELL: ObjKind.CELL,
    OpKind.DEL_CELL: ObjKind.CELL,
}

#: Number of values each op carries in ``Op.args``.
OP_ARITY: dict[OpKind, int] = {
    OpKind.STORE_ATTR: 1,
    OpKind.DEL_ATTR: 0,
    OpKind.GENERIC_SETATTR: 1,
    OpKind.GENERIC_DELATTR: 0,
    OpKind.LIST_APPEND: 1,
    OpKind.LIST_EXTEND: -1,
    OpKind.LIST_SETITEM: 1,
    OpKind.LIST_DELITEM: 0,
    OpKind.LIST_INSERT: 1,
    OpKind.LIST_POP: 0,
    OpKind.LIST_CLEAR: 0,
    OpKind.LIST_REVERSE: 0,
    OpKind.DICT_SETITEM: 1,
    OpKind.DICT_DELITEM: 0,
    OpKind.DICT_CLEAR: 0,
    OpKind.SET_ADD: 0,
    OpKind.SET_DISCARD: 0,
    OpKind.SET_CLEAR: 0,
    OpKind.STORE_GLOBAL: 1,
    OpKind.DEL_GLOBAL: 0,
    OpKind.STORE_CELL: 1,
    OpKind.DEL_CELL: 0,
}

#: Ops whose ``key`` is meaningful (attr name, index, dict key, set element, global name).
KEYED_OPS: frozenset[OpKind] = frozenset(
    {
        OpKind.STORE_ATTR,
        OpKind.DEL_ATTR,
        OpKind.GENERIC_SETATTR,
        OpKind.GENERIC_DELATTR,
        OpKind.LIST_SETITEM,
        OpKind.LIST_DELITEM,
        OpKind.LIST_INSERT,
        OpKind.LIST_POP,
        OpKind.DICT_SETITEM,
        OpKind.DICT_DELITEM,
        OpKind.SET_ADD,
        OpKind.SET_DISCARD,
        OpKind.STORE_GLOBAL,
        OpKind.DEL_GLOBAL,
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One mutation of pre-existing state, in program order.

    ``key`` is the attribute name, list index, dict key, set element or global
    name (``None`` when the op has none); ``args`` holds the stored values.
    ``where`` is the user's file:line (diagnostics only, not part of describe).
    """

    kind: OpKind
    target: Ref | None
    key: Any = None
    args: tuple[Value, ...] = ()
    where: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class NewObject:
    """A new object that escapes, materialized with its final state.

    ``cls`` is its class (a list/dict/set subclass keeps its own class and is
    filled through the base type's methods). ``items`` holds list or set
    contents, ``entries`` dict pairs, ``attrs`` instance attributes in first
    store order, ``contents`` a cell's value (``()`` for an empty cell, else a
    1-tuple), and ``function`` (code, name, defaults, closure refs) for a
    function created by the hook.
    """

    ref: Ref
    cls: type
    items: tuple[Value, ...] = ()
    entries: tuple[tuple[Any, Value], ...] = ()
    attrs: tuple[tuple[str, Value], ...] = ()
    contents: tuple[Value, ...] = ()
    function: FunctionSpec | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionSpec:
    """What ``MAKE_FUNCTION`` built: materialized with the hook's globals."""

    code: Any
    name: str
    defaults: tuple[Value, ...] = ()
    closure: tuple[Ref, ...] = ()
    kwdefaults: tuple[tuple[str, Value], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PreexistingObject:
    """A pre-existing object the plan reaches; fetched before any op runs."""

    ref: Ref
    source: Source


def describe_type(cls: type) -> str:
    """Deterministic text for a class (module and qualified name)."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_value(value: Value, names: dict[Ref, str]) -> str:
    """Deterministic text for a recorded value; ``names`` names the tracked refs."""
    if isinstance(value, Ref):
        return names.get(value, f"<untracked ref {value.index}>")
    if isinstance(value, TensorSlot | Original):
        return value.describe()
    if isinstance(value, Computed):
        lhs, rhs = describe_value(value.lhs, names), describe_value(value.rhs, names)
        if value.op in ("min", "max"):
            return f"{value.op}({lhs}, {rhs})"
        return f"({lhs} {value.op} {rhs})"
    if type(value) is tuple:
        inner = ", ".join(describe_value(v, names) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if type(value) is frozenset:
        return "frozenset({" + ", ".join(sorted(repr(v) for v in value)) + "})"
    return repr(value)
