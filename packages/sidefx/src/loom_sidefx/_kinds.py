"""How Python objects map to the kinds the log models, and which raw operations are sound.

A tracked object is modeled by its base kind (a list subclass is a ``LIST``).
Replay mutates through the base type and stores attributes with
``object.__setattr__``; these predicates say when that runs no user code and
cannot fail: a new object whose class has only Python-level bases up to its
kind's base type, an attribute that no data descriptor manages.
"""

from __future__ import annotations

import types
from typing import Any

from ._values import ObjKind

__all__ = ["BASE_OF_KIND", "attr_refusal", "has_instance_attr", "kind_of", "materialize_refusal"]

_MISSING: Any = object()
_HEAPTYPE = 1 << 9


def kind_of(obj: object) -> ObjKind:
    """The kind the log models ``obj`` as (a subclass keeps its base's kind)."""
    if isinstance(obj, list):
        return ObjKind.LIST
    if isinstance(obj, dict):
        return ObjKind.DICT
    if isinstance(obj, set):
        return ObjKind.SET
    if isinstance(obj, types.CellType):
        return ObjKind.CELL
    if isinstance(obj, types.FunctionType):
        return ObjKind.FUNCTION
    return ObjKind.OBJECT


BASE_OF_KIND: dict[ObjKind, type] = {
    ObjKind.LIST: list,
    ObjKind.DICT: dict,
    ObjKind.SET: set,
    ObjKind.CELL: types.CellType,
    ObjKind.FUNCTION: types.FunctionType,
    ObjKind.OBJECT: object,
}


def materialize_refusal(cls: type, kind: ObjKind) -> str | None:
    """Why ``base.__new__(cls)`` cannot build a new ``cls`` without user code, or None."""
    base = BASE_OF_KIND[kind]
    if not isinstance(cls, type) or not issubclass(cls, base):
        return f"{cls!r} is not a subclass of {base.__name__}"
    if kind in (ObjKind.CELL, ObjKind.FUNCTION):
        return None if cls is base else f"{cls.__qualname__} subclasses {base.__name__}"
    for c in cls.__mro__:
        if c is base or c is object:
            break
        if not c.__flags__ & _HEAPTYPE:
            return f"{cls.__qualname__} has the C base {c.__qualname__}"
    return None


def attr_refusal(cls: type, name: str) -> str | None:
    """Why a raw ``object.__setattr__``/``__delattr__`` of ``name`` on a ``cls`` is unsound."""
    for c in cls.__mro__:
        attr = vars(c).get(name, _MISSING)
        if attr is _MISSING:
            continue
        t = type(attr)
        if isinstance(attr, types.MemberDescriptorType):
            return None
        if hasattr(t, "__set__") or hasattr(t, "__delete__"):
            return f"{cls.__qualname__}.{name} is a data descriptor ({t.__qualname__})"
        break
    if not any("__dict__" in vars(c) for c in cls.__mro__):
        return f"{cls.__qualname__} instances have no __dict__"
    return None


def has_instance_attr(obj: object, name: str) -> bool:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        d = {}
    if isinstance(d, dict | types.MappingProxyType) and name in d:
        return True
    for c in type(obj).__mro__:
        slot = vars(c).get(name)
        if isinstance(slot, types.MemberDescriptorType):
            try:
                slot.__get__(obj, type(obj))
            except AttributeError:
                return False
            return True
    return False
