"""What a Python object is to the tracer: a constant it may bake into a trace, or a
symbolic size.

``is_const`` holds for immutable data (``None``, numbers, strings, torch atoms,
ranges, slices and tuples of them); the tracer bakes such a value into the graph
after a guard when it came from a source. ``is_symbolic`` holds for a size of a
tensor traced with dynamic shapes (or a tuple or list holding one); such a value
never becomes a Python constant or a replayed value.
"""

from __future__ import annotations

import torch

_CONST_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    range,
    slice,
    type(Ellipsis),
)


def is_const(obj: object) -> bool:
    """Immutable data that can be baked into a trace (after a guard if it came from a source)."""
    if isinstance(obj, (tuple, frozenset)) and type(obj) in (tuple, frozenset):
        return all(is_const(x) for x in obj)
    return type(obj) in _CONST_TYPES or isinstance(obj, BaseException)


SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic(value: object) -> bool:
    """Whether a value is, or holds, a size of a tensor with dynamic shapes."""
    if isinstance(value, SYMBOLIC_TYPES):
        return True
    if isinstance(value, (tuple, list)):
        return any(is_symbolic(x) for x in value)
    return False
