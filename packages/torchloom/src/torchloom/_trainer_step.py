"""What the trainer integrations share: a batch as flat step arguments, and the
hooks of a trainer that run user code inside its step.

A trainer hands its step a batch (a tensor, a tuple, a dict); ``capture_step``'s
per-call check takes flat positional and keyword arguments only, so a batch is
split into them and rebuilt inside the step (a nested batch is passed whole, and
goes through the full guard on every call). Whatever else a trainer's step reads
that can change between calls (an accumulation flag, a divisor) is passed as a
plain argument too, so the guard compares it by value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Rebuild", "overridden_hooks", "split_batch"]

#: Rebuilds a batch from the step's positional and keyword arguments.
Rebuild = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Rebuild]:
    """``batch`` as ``(args, kwargs, rebuild)``, ``rebuild(args, kwargs)`` being ``batch``
    with those values in its place."""
    cls = type(batch)
    if isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
        return (), dict(batch), lambda args, kwargs: dict(kwargs)
    if cls in (tuple, list):
        return tuple(batch), {}, lambda args, kwargs: cls(args)
    if isinstance(batch, tuple) and hasattr(cls, "_fields"):  # a namedtuple
        return tuple(batch), {}, lambda args, kwargs: cls(*args)
    return (batch,), {}, lambda args, kwargs: args[0]


def _where(fn: Any, qualname: str) -> str:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return qualname
    return f"{code.co_filename}:{code.co_firstlineno} in {qualname}"


def overridden_hooks(
    objects: Sequence[Any], hooks: Sequence[str], library: tuple[str, ...]
) -> list[tuple[str, str]]:
    """``(where, "Class.hook")`` of each hook in ``hooks`` that an object's class defines
    outside the ``library`` packages (its own code runs there)."""
    found = []
    for obj in objects:
        for hook in hooks:
            owner = next((c for c in type(obj).__mro__ if hook in vars(c)), None)
            if owner is None or owner.__module__.startswith(library):
                continue
            name = f"{owner.__qualname__}.{hook}"
            found.append((_where(vars(owner)[hook], name), name))
    return found
