"""Shared helpers: a structural picture of Python state that sees types and aliasing."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest


def shape(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """Contents, exact types and sharing of an object graph (no addresses)."""
    seen = {} if seen is None else seen
    if isinstance(obj, int | float | str | bytes | bool | type(None)):
        return (type(obj).__name__, obj)
    if id(obj) in seen:
        return ("alias", seen[id(obj)])
    seen[id(obj)] = len(seen)
    name = type(obj).__qualname__
    if isinstance(obj, list | tuple):
        return (name, [shape(x, seen) for x in obj], _attrs(obj, seen))
    if isinstance(obj, dict):
        return (name, [(k, shape(v, seen)) for k, v in obj.items()], _attrs(obj, seen))
    if isinstance(obj, set | frozenset):
        return (name, sorted(map(repr, obj)))
    if isinstance(obj, types.CellType):
        try:
            return (name, shape(obj.cell_contents, seen))
        except ValueError:
            return (name, "<empty>")
    if isinstance(obj, types.FunctionType | type | types.ModuleType):
        return (name, getattr(obj, "__qualname__", None), _attrs(obj, seen))
    return (name, _attrs(obj, seen))


def _attrs(obj: Any, seen: dict[int, int]) -> Any:
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return None
    return [(k, shape(v, seen)) for k, v in d.items()]


@pytest.fixture
def state_shape() -> Callable[[Any], Any]:
    return shape
