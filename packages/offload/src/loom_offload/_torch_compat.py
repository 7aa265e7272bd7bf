"""The private torch names loom_offload touches, in one place (no behaviour here).

- ``storage_references(t)``: how many tensors hold ``t``'s storage (the pinned pool
  hands a block out again only when it holds the last reference);
- Inductor's lowering registry, its fallback kernel and the set of buffers its
  wrapper must never reuse in place: an offloaded buffer is read by a copy on the
  transfer stream after the compute stream moved on, so Inductor must free it to
  the caching allocator (which keeps stream order) instead of handing its memory
  to a later kernel of the same graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "OpOverload",
    "fake_mode_of",
    "is_non_overlapping_and_dense",
    "never_reuse_input_buffer",
    "register_inductor_fallback",
    "storage_references",
]


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its span exactly once (some permutation of contiguous).

    Computed here (no private torch name): dimensions of size one never matter; the
    others, by increasing stride, must each step over exactly the ones before them.
    """
    dims = sorted((int(st), int(sz)) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def fake_mode_of(t: torch.Tensor) -> Any:
    """The fake mode that owns ``t`` (``None`` for a real tensor)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.fake_mode if isinstance(t, FakeTensor) else None


#: The type of one overload of an operator (``torch.ops.ns.op.default``).
OpOverload = torch._ops.OpOverload


def storage_references(t: torch.Tensor) -> int:
    """Tensors (and storages) that hold ``t``'s storage, not counting this call's own."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # a release without it: every block counts as taken (never reused)
        return 2
    storage = t.untyped_storage()
    # NOTE: ``untyped_storage()`` makes a Python storage object, one reference more.
    return int(count(storage._cdata)) - 1


def register_inductor_fallback(op: OpOverload, *, protect_first_input: bool) -> Callable[[], None]:
    """A function that registers ``op`` with Inductor as a fallback kernel (an extern
    call); with ``protect_first_input`` the buffer its first argument reads is never
    reused in place by the generated wrapper. Importing Inductor is deferred to the
    first compile that needs it."""

    @functools.cache
    def register() -> None:
        from torch._inductor import lowering

        handler = lowering.fallback_handler(op, add_to_fallback_set=False)  # type: ignore[no-untyped-call]

        def lower(*args: Any, **kwargs: Any) -> Any:
            if protect_first_input and args:
                never_reuse_input_buffer(args[0])
            return handler(*args, **kwargs)

        lowering.register_lowering(op, type_promotion_kind=None)(lower)

    return register


def never_reuse_input_buffer(node: Any) -> None:
    """Mark the Inductor buffer under ``node`` (a TensorBox, view or buffer) as never
    reused in place by the graph's wrapper."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    if isinstance(node, ir.TensorBox):
        node.realize()
    inner = node
    while not isinstance(inner, ir.Buffer) and hasattr(inner, "data"):
        inner = inner.data
    if isinstance(inner, ir.Buffer):
        V.graph.never_reuse_buffers.add(inner.get_name())
