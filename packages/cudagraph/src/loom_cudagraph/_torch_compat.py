"""loom_cudagraph's only door to private torch APIs (pinned: torch 2.11).

Operator classes, the storage use count that output-liveness checks read, the
fused copy used to fill static input buffers, and the process groups that
functional collectives name. A torch upgrade is a diff
of this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = [
    "HAS_NATIVE_DATA_PTRS_CHECK",
    "NO_ARGUMENT",
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "clear_cublas_workspaces",
    "cuda_graph_replay",
    "data_ptrs_at_indices_equal",
    "foreach_copy_",
    "free_unbacked_symbols",
    "holds_own_memory",
    "is_fake_or_meta",
    "is_mutable_op",
    "mark_boxed",
    "mutated_args",
    "named_argument",
    "non_overlapping_and_dense",
    "non_owning_alias",
    "process_group_backend",
    "process_group_names",
    "storage_id",
    "storage_use_count",
    "storage_weak_ref",
]


def storage_id(t: torch.Tensor) -> int:
    """The address of the tensor's StorageImpl (stable while the storage lives)."""
    return int(t.untyped_storage()._cdata)


#: How many references (tensors, views, storages) hold a StorageImpl now (by its address).
storage_use_count: Callable[[int], int] = torch._C._storage_Use_Count


class StorageWeakRef(Protocol):
    def expired(self) -> bool: ...


def storage_weak_ref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: ``expired()`` once nothing holds it (its
    memory then went back to the allocator). It keeps the StorageImpl's address from
    being reused while it lives."""
    from torch.multiprocessing.reductions import StorageWeakRef as _Ref

    ref: StorageWeakRef = _Ref(t.untyped_storage())  # type: ignore[no-untyped-call]
    return ref


def holds_own_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is memory of its own (a wrapper subclass such as
    DTensor has a storage that is no memory at all: its inner tensors hold it)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return not is_traceable_wrapper_subclass(t)


def non_owning_alias(
    t: torch.Tensor, storages: dict[int, torch.UntypedStorage] | None = None
) -> torch.Tensor:
    """``t`` again, over a storage that views the same memory without owning it:
    same address, dtype, size, strides and offset; dropping it frees nothing.

    ``storages`` maps a storage's address to its non-owning twin, so that tensors
    sharing a storage share the twin (their liveness is then one use count).
    """
    storage = t.untyped_storage()
    key = int(storage._cdata)
    twin: Any = None if storages is None else storages.get(key)
    if twin is None:
        twin = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), t.device, storage.nbytes()
        )
        if storages is not None:
            storages[key] = twin
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        alias.set_(twin, t.storage_offset(), t.size(), t.stride())
    return alias


TensorList = list[torch.Tensor] | tuple[torch.Tensor, ...]

#: ``dst[i].copy_(src[i])`` for all ``i`` (lists or tuples, non-empty), the op itself:
#: the per-call path binds it to a recording's buffers once.
foreach_copy_: Callable[[TensorList, TensorList], None] = torch._foreach_copy_


def _data_ptrs_at_indices_equal_py(
    tensors: list[Any], ptrs: list[int | None], indices: list[int]
) -> bool:
    """The Python spelling of the C++ check (torch 2.13 and later removed it with
    the old cudagraph trees' input check)."""
    for i in indices:
        t = tensors[i]
        if not isinstance(t, torch.Tensor) or t.data_ptr() != ptrs[i]:
            return False
    return True


#: Whether this torch has the one-call C++ check (2.11, 2.12; removed in 2.13).
HAS_NATIVE_DATA_PTRS_CHECK: bool = hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal")

#: ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` in ``indices`` (one C++ call, no
#: wrapper, where torch has it; a Python loop with the same answer elsewhere).
data_ptrs_at_indices_equal: Callable[[list[Any], list[int | None], list[int]], bool] = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", _data_ptrs_at_indices_equal_py
)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (absent on CPU-only builds: nothing to
    drop). Around a capture, so that the workspace a capture needs is allocated in
    its pool and then freed there (scratch memory later captures may reuse), as
    CUDA-graph trees do, rather than staying allocated for the process."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def cuda_graph_replay(graph: Any) -> Callable[[], object]:
    """``graph.replay`` bound to the C++ method itself, past ``torch.cuda.CUDAGraph``'s
    Python override (which only calls ``super().replay()``): one frame less per replay."""
    replay: Callable[[], object] = torch._C._CUDAGraph.replay.__get__(graph)
    return replay


def free_unbacked_symbols(value: Any) -> set[Any]:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as _free

    return set(_free(value))


def is_fake_or_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def is_mutable_op(target: OpOverload) -> bool:
    """Whether the operator's schema declares that it writes an argument."""
    return bool(target._schema.is_mutable)


def mark_boxed(fn: Any) -> None:
    """Mark ``fn`` as taking its inputs as one list (AOTAutograd's boxed calling
    convention, read off the ``_boxed_call`` attribute)."""
    fn._boxed_call = True


def mutated_args(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an operator call writes to, from its schema's alias annotations."""
    if not isinstance(target, OpOverload):
        return []
    schema = target._schema
    if not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if i < len(args):
                out.append(args[i])
            elif arg.name in kwargs:
                out.append(kwargs[arg.name])
    return out


#: ``named_argument``'s answer for an operator whose schema has no such argument.
NO_ARGUMENT: Any = object()


def named_argument(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """The value an operator call passes for its schema argument ``name``
    (``NO_ARGUMENT`` when the schema has none; ``None`` when the call leaves it out)."""
    if not isinstance(target, OpOverload):
        return NO_ARGUMENT
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return NO_ARGUMENT


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory exactly once (so a same-strided copy is exact)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return bool(is_non_overlapping_and_dense_or_false(t))


def process_group_backend(group_name: str, device_type: str) -> str:
    """The name of the backend (``"nccl"``, ``"gloo"``, ...) that the process group
    registered as ``group_name`` (a functional collective's ``group_name`` argument)
    uses for tensors of ``device_type``. :class:`LookupError` when torch.distributed is
    not initialized, no group of this process has that name, or the group has no backend
    for the device."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise LookupError("torch.distributed is not initialized in this process")
    from torch.distributed import distributed_c10d as c10d

    try:
        group = c10d._resolve_process_group(c10d.GroupName(group_name))  # type: ignore[attr-defined]
        backend = group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise LookupError(str(exc)) from None
    return str(backend.name()).lower()


def process_group_names() -> tuple[str, ...]:
    """The names of the process groups this process belongs to (sorted; none when
    torch.distributed is not initialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ()
    from torch.distributed import distributed_c10d as c10d

    return tuple(sorted(str(name) for name in c10d._world.pg_names.values()))
