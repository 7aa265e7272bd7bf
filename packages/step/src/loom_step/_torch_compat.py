"""loom_step's only door to private torch APIs (pinned: torch 2.11).

Pytree flattening of a step's arguments and outputs, the storage use count that
the held-output check reads, Dynamo's C++ checks of tensors and global state
that the per-call check reuses, the fused copy that fills argument buffers, and
the one-call pointer check, a DTensor's local memory, DDP's timer logging and
FSDP2's state (its streams, offload policy and post-optimizer event).
Version-dependent names and small adapters, no behaviour: a torch upgrade is a
diff of this file.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "LOCAL_TENSOR",
    "address",
    "all_gather_object",
    "all_reduce_min",
    "data_ptrs_equal",
    "distributed_initialized",
    "foreach_copy_",
    "fsdp2_comm_streams",
    "fsdp2_forget_events",
    "fsdp2_offloads",
    "fsdp2_post_optim_event",
    "global_state_check",
    "host_group",
    "is_fsdp2_module",
    "local_tensor",
    "memory_tensors",
    "reach",
    "rebuild_ddp_reducer",
    "rehearsing_capture",
    "set_ddp_runtime_logging_sample_rate",
    "storage_counter",
    "storage_use_count",
    "tensors_check",
    "tree_flatten",
    "tree_unflatten",
]


@contextlib.contextmanager
def rehearsing_capture() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` answers ``True`` inside, for Python
    code that looks it up at call time. Libraries branch on it (transformers
    materializes the attention mask instead of skipping it after a host check; torch's
    optimizers and SyncBatchNorm skip checks), so a warm-up under it runs the code a
    capture will run, and whatever that code compiles (a Dynamo recompile for the new
    branch) is compiled there, not inside the capture, where compiling fails."""
    saved = torch.cuda.is_current_stream_capturing

    def capturing() -> bool:
        return True

    torch.cuda.is_current_stream_capturing = capturing
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = saved


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


#: A ``DTensor``'s local tensor, read at C speed (``local_tensor`` checks the class first).
LOCAL_TENSOR = operator.attrgetter("_local_tensor")
#: Tensor classes whose ``data_ptr()`` is their own memory's address (no wrapper).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding a ``DTensor``'s memory on this rank (its ``_local_tensor``),
    or ``None`` for any other tensor."""
    if t.__class__ in _PLAIN:
        return None
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


def memory_tensors(t: torch.Tensor) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """The plain tensors that hold ``t``'s memory, each with the attribute path from
    ``t`` to it: ``t`` itself (path ``()``), or, for a wrapper subclass without memory
    of its own (a ``DTensor``: its ``_local_tensor``), the inner tensors its
    ``__tensor_flatten__`` names, recursively."""
    if t.__class__ in _PLAIN or not _is_wrapper_subclass(t):
        return [((), t)]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    # NOTE: the tensors among the names only: torch 2.15's DTensor names its device mesh
    # (an opaque object) beside its local tensor
    inners = [(name, getattr(t, name)) for name in names]
    return [
        ((name, *path), leaf)
        for name, inner in inners
        if isinstance(inner, torch.Tensor)
        for path, leaf in memory_tensors(inner)
    ]


def reach(t: torch.Tensor, path: Sequence[str]) -> torch.Tensor:
    """The tensor at ``path`` under ``t`` (a path :func:`memory_tensors` gave)."""
    for name in path:
        t = getattr(t, name)
    return t


def _is_wrapper_subclass(t: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return bool(is_traceable_wrapper_subclass(t))


def address(t: torch.Tensor) -> int:
    """The address of the memory a replay reads for ``t``: its ``data_ptr()``, or its
    local tensor's for a ``DTensor`` (a wrapper without storage, whose own
    ``data_ptr()`` is 0 on every DTensor: FSDP2's parameters, gradients and optimizer
    state)."""
    if t.__class__ in _PLAIN:
        return int(t.data_ptr())
    inner = local_tensor(t)
    return int((inner if inner is not None else t).data_ptr())


# --- torch.distributed: DDP's timer logging, FSDP2's state, the ranks' agreement --------------------------


def set_ddp_runtime_logging_sample_rate(ddp: torch.nn.Module, rate: int) -> None:
    """``DistributedDataParallel._set_ddp_runtime_logging_sample_rate`` (a DDP with the
    Python reducer has none)."""
    setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None and getattr(ddp, "reducer", None) is not None:
        setter(rate)


def rebuild_ddp_reducer(ddp: torch.nn.Module, compiled: Sequence[Any] = ()) -> None:
    """Build ``ddp``'s reducer anew on the current stream, as DDP's own ``__setstate__``
    does: the old reducer is dropped first, and with it the ``AccumulateGrad`` node of
    every parameter it kept (nothing else holds them between steps), so the new reducer
    makes them anew and each records the current stream. The communication hooks (Python
    ones, mixed precision's included, and a built-in one, which DDP records by name only),
    the mixed-precision dtype and the static-graph setting carry over to the new reducer.

    ``compiled``: modules that ``torch.compile`` made of ``ddp``. Dynamo wraps ``ddp`` in
    functions made with ``functools.wraps``, which copies the module's ``__dict__``, its
    reducer and logger included, into each wrapper's: those copies would keep the old
    reducer (and its nodes) alive, so they are pointed at the new one."""
    import torch.distributed as dist

    d: Any = ddp
    copies = _ddp_state_copies(ddp, compiled)
    for copy in copies:
        copy["reducer"] = copy["logger"] = None
    hooks = list(d._comm_hooks)
    data = d._get_ddp_logging_data()
    name = data.get("comm_hook") if isinstance(data, dict) else None
    builtin = None
    if name and name not in {hook.__qualname__ for hook, _ in hooks}:
        kinds = dist.BuiltinCommHookType  # type: ignore[attr-defined]
        builtin = getattr(kinds, str(name).rsplit(".", 1)[-1])
    d.reducer = None
    d.logger = None  # holds the reducer
    params, sparse = d._build_params_for_reducer()
    names = d._build_debug_param_to_name_mapping(params)
    d._ddp_init_helper(params, sparse, names, d.static_graph)
    for hook, state in hooks:
        d.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(d.reducer, state, hook)  # type: ignore[attr-defined]
    if builtin is not None:
        d.logger._set_comm_hook_name(str(builtin))
        dist._register_builtin_comm_hook(d.reducer, builtin)  # type: ignore[attr-defined]
    if d.mixed_precision is not None:
        d.reducer._set_mixed_precision_param_dtype(d.mixed_precision.param_dtype)
    if d.static_graph:
        d.reducer._set_static_graph()
        d.logger._set_static_graph()
    for copy in copies:
        copy["reducer"], copy["logger"] = d.reducer, d.logger


def _ddp_state_copies(ddp: torch.nn.Module, compiled: Sequence[Any]) -> list[dict[str, Any]]:
    """The ``__dict__`` of each function between a compiled module's ``forward`` and
    ``ddp`` (followed through ``__wrapped__``) that holds ``ddp``'s reducer."""
    reducer = getattr(ddp, "reducer", None)
    found: list[dict[str, Any]] = []
    for module in compiled:
        fn = getattr(module, "forward", None)
        for _ in range(16):  # a wrapper chain is a few functions long
            if fn is None or fn is ddp:
                break
            state = getattr(fn, "__dict__", None)
            if isinstance(state, dict) and state.get("reducer") is reducer:
                found.append(state)
            fn = getattr(fn, "__wrapped__", None)
    return found


def is_fsdp2_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``fully_shard`` (its class became
    ``FSDP<Class>``, an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _fsdp2_state(module: torch.nn.Module) -> Any:
    get = getattr(module, "_get_fsdp_state", None)
    return get() if get is not None else None


def fsdp2_comm_streams(module: torch.nn.Module) -> list[Any]:
    """The side streams FSDP2 runs ``module``'s collectives on: the all-gather copy-in,
    all-gather, reduce-scatter and all-reduce streams it makes at its lazy init (the
    root's, shared by every module under it), and a user's all-reduce hook stream;
    empty before the first forward."""
    state = _fsdp2_state(module)
    if state is None:
        return []
    ctx = getattr(state, "_comm_ctx", None)
    names = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream")
    streams = [getattr(ctx, n, None) for n in (*names, "all_reduce_stream")]
    group = getattr(state, "_fsdp_param_group", None)
    streams.append(getattr(group, "_all_reduce_hook_stream", None))
    return [s for s in streams if s is not None]


def fsdp2_forget_events(module: torch.nn.Module) -> None:
    """Drop the CUDA events FSDP2 keeps between ``module``'s collectives (the last
    all-gather's, the reduce-scatter's, the post-reduce event) and the results they
    guard. After a failed capture they are events recorded inside it, which a later
    eager wait rejects ("invalid argument"); eagerly, FSDP2 clears them itself by the
    end of each step, so an eager step after this finds what it expects."""
    state = _fsdp2_state(module)
    if state is None:
        return
    ctx = getattr(state, "_comm_ctx", None)
    if ctx is not None:
        ctx.all_gather_state = None
        ctx.reduce_scatter_state = None
    group = getattr(state, "_fsdp_param_group", None)
    if group is not None:
        group._all_gather_result = None
        group._post_reduce_event = None
        group._all_reduce_state = None


def fsdp2_offloads(module: torch.nn.Module) -> bool:
    """Whether ``module``'s FSDP2 parameters are offloaded to the host
    (``fully_shard(..., offload_policy=CPUOffloadPolicy())``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    state = _fsdp2_state(module)
    group = getattr(state, "_fsdp_param_group", None)
    return isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)


def fsdp2_post_optim_event(module: torch.nn.Module) -> Any:
    """The event ``module.set_post_optim_event(event)`` left for FSDP2's next root
    forward to wait on (``None``: the forward waits on the current stream)."""
    state = _fsdp2_state(module)
    ctx = getattr(state, "_state_ctx", None)
    return getattr(ctx, "post_optim_event", None)


def distributed_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


#: gloo groups made for agreement, by the ranks they span (made once per process).
_HOST_GROUPS: dict[tuple[int, ...], Any] = {}


def host_group(group: Any) -> tuple[Any, int]:
    """A gloo group over ``group``'s ranks (``None``: the default group) and its size:
    ``group`` itself when it is gloo, else one made with ``new_group`` (a collective
    call over the default group, made once per set of ranks)."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size < 2 or dist.get_backend(group) == "gloo":
        return group, size
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _HOST_GROUPS[ranks], size


def all_reduce_min(value: int, group: Any) -> int:
    """The minimum of ``value`` over ``group``'s ranks (a host tensor: no device work)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0])


def all_gather_object(value: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
