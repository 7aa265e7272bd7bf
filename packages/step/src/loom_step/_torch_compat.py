"""loom_step's only door to private torch APIs (pinned: torch 2.11).

Pytree flattening of a step's arguments and outputs, the storage use count that
the held-output check reads, Dynamo's C++ checks of tensors and global state
that the per-call check reuses, the fused copy that fills argument buffers, and
the one-call pointer check. Version-dependent names and small adapters, no
behaviour: a torch upgrade is a diff of this file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "data_ptrs_equal",
    "foreach_copy_",
    "global_state_check",
    "storage_counter",
    "storage_use_count",
    "tensors_check",
    "tree_flatten",
    "tree_unflatten",
]


def tree_flatten(value: Any) -> tuple[list[Any], Any]:
    """A step's arguments or outputs as leaves and a structure (compared with ``==``)."""
    from torch.utils._pytree import tree_flatten as _flatten

    return _flatten(value)


def tree_unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    from torch.utils._pytree import tree_unflatten as _unflatten

    return _unflatten(list(leaves), spec)


def storage_use_count(t: torch.Tensor) -> int:
    """How many references hold the tensor's storage (tensors and views sharing it)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def storage_counter(t: torch.Tensor) -> Callable[[], int]:
    """A C-level callable giving :func:`storage_use_count`'s count of ``t``'s storage
    (plus one, the storage object this makes, which lives as long as the storage), with
    no Python object made per call. ``t`` must outlive the callable (it holds the storage)."""
    cdata: int = t.untyped_storage()._cdata
    return functools.partial(torch._C._storage_Use_Count, cdata)


#: Dynamo's C++ checks of tensors and of global state, where torch has them.
_DYNAMO_GUARDS = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_TENSOR_GUARDS: Any = getattr(_DYNAMO_GUARDS, "TensorGuards", None)
_GLOBAL_STATE_GUARD: Any = getattr(_DYNAMO_GUARDS, "GlobalStateGuard", None)


def tensors_check(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """A C++ check that the tensors passed to it (positionally, as many as ``tensors``)
    have the class, dtype, device, ``requires_grad``, sizes and strides of ``tensors``
    (and their dispatch keys): Dynamo's ``TensorGuards``. Stricter than a step's
    argument guard (strides), never weaker. ``None`` where torch lacks it or it does
    not take these tensors (sparse ones)."""
    if _TENSOR_GUARDS is None:
        return None
    try:
        guard = _TENSOR_GUARDS(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        check: Callable[..., bool] = guard.check
        if not check(*tensors):
            return None
    except (RuntimeError, TypeError, ValueError, SystemError):
        return None
    return check


def global_state_check(fallback: Callable[[], Any]) -> Callable[[], bool]:
    """A C-level check that grad mode, whether autocast is on (per device type) and the
    autocast cache are as they are now (not the autocast dtypes): Dynamo's
    ``GlobalStateGuard``, which checks more global state besides (a ``False`` may be a
    false alarm, never a missed change). Where torch lacks it: ``fallback()`` compared
    with its value now, in Python."""
    if _GLOBAL_STATE_GUARD is not None:
        check: Callable[[], bool] = _GLOBAL_STATE_GUARD().check
        return check
    now = fallback()
    return lambda: bool(fallback() == now)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, as one fused op."""
    torch._foreach_copy_(list(dst), list(src))


def _data_ptrs_equal_py(tensors: list[Any], ptrs: list[int | None], indices: list[int]) -> bool:
    """The Python spelling of the C++ check (torch 2.13 and later removed it)."""
    for i in indices:
        t = tensors[i]
        if not isinstance(t, torch.Tensor) or t.data_ptr() != ptrs[i]:
            return False
    return True


#: ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` in ``indices`` (lists): one C++
#: call where torch has it (2.11, 2.12), a Python loop with the same answer elsewhere.
data_ptrs_equal: Callable[[list[Any], list[int | None], list[int]], bool] = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", _data_ptrs_equal_py
)
