"""The only module of loom_resize that touches private torch APIs (torch 2.11).

It names the ops the passes look for in the form each graph carries them: the
Dynamo graph calls ``torch.ops.inductor.resize_storage_bytes_`` (the overload
packet), ``Tensor.copy_`` as a method and ``torch._foreach_copy_``; AOTAutograd's
graphs call the ``.default`` overloads. ``fsdp.copy_`` is registered by FSDP2's
``_fsdp_param`` module, imported here on first use.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "FOREACH_COPY_TARGETS",
    "RESIZE_TARGETS",
    "TENSOR_COPY_TARGETS",
    "aot_eager_backend",
    "foreach_copy_",
    "fsdp_copy",
    "fsdp_copy_targets",
    "is_tensor_subclass",
    "is_view_op",
    "preserve_version_counter",
    "set_grad_enabled_target",
    "written_arguments",
]

_resize_packet = torch.ops.inductor.resize_storage_bytes_
RESIZE_TARGETS: frozenset[Any] = frozenset({_resize_packet, _resize_packet.default})
TENSOR_COPY_TARGETS: frozenset[Any] = frozenset({torch.ops.aten.copy_.default, torch.Tensor.copy_})
FOREACH_COPY_TARGETS: frozenset[Any] = frozenset(
    {torch._foreach_copy_, torch.ops.aten._foreach_copy_.default}
)


def set_grad_enabled_target() -> Any:
    """``torch._C._set_grad_enabled``: how Dynamo records ``no_grad`` blocks."""
    return torch._C._set_grad_enabled


@functools.cache
def fsdp_copy() -> Any:
    """``torch.ops.fsdp.copy_.default``: an in-place copy that AOTAutograd does
    not functionalize (registered by FSDP2; imported here on first use)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param

    return torch.ops.fsdp.copy_.default


def fsdp_copy_targets() -> frozenset[Any]:
    op = fsdp_copy()
    return frozenset({op, op._overloadpacket})


def is_tensor_subclass(value: Any) -> bool:
    """True for a traceable wrapper subclass (DTensor, ...) or any other subclass
    of ``torch.Tensor`` other than ``nn.Parameter`` and fake/functional tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(value):
        return True
    return type(value) not in (torch.Tensor, torch.nn.Parameter, FakeTensor, FunctionalTensor)


@contextlib.contextmanager
def preserve_version_counter(t: torch.Tensor) -> Iterator[None]:
    """``torch.autograd._unsafe_preserve_version_counter``: FSDP2 wraps its
    resize-and-copy in it so tensors saved for backward stay valid."""
    with torch.autograd._unsafe_preserve_version_counter(t):  # type: ignore[attr-defined]
        yield


def aot_eager_backend(
    fw_compiler: Callable[..., Any],
    bw_compiler: Callable[..., Any],
    partition_fn: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A Dynamo backend running AOTAutograd with the given compilers (tests)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def boxed(compiler: Callable[..., Any]) -> Callable[..., Any]:
        def inner(gm: Any, example_inputs: Any) -> Any:
            from functorch.compile import make_boxed_func  # type: ignore[import-untyped]

            return make_boxed_func(compiler(gm, example_inputs))

        return inner

    return aot_autograd(  # type: ignore[no-any-return]
        fw_compiler=boxed(fw_compiler),
        bw_compiler=boxed(bw_compiler),
        inference_compiler=boxed(fw_compiler),
        partition_fn=partition_fn
        or functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        keep_inference_input_mutations=True,
    )


def written_arguments(target: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op overload mutates, by its schema."""
    if not isinstance(target, torch._ops.OpOverload):
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(target._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def is_view_op(target: Any) -> bool:
    """True for an op overload whose output aliases its first input."""
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``torch._foreach_copy_``: the multi-tensor fill FSDP2's copy-in uses."""
    torch._foreach_copy_(dsts, srcs)
