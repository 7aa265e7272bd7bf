"""The two operators a lowered offload pair becomes.

``loom_offload::offload(t, window_bytes) -> host`` starts the copy of ``t`` to a
host pool block and returns the block (``t``'s sizes, dtype and, when dense, its
strides). ``loom_offload::reload(host, device, prefetch) -> t`` returns it on
``device`` once copied, after starting the reloads of ``prefetch``. Both are opaque
to AOTAutograd and Inductor (fallback kernels); Inductor never reuses an offloaded
buffer in place, since the transfer stream may still read it.
"""

from __future__ import annotations

import torch

from loom_offload._pool import dense_span
from loom_offload._runtime import transfers_for
from loom_offload._torch_compat import OpOverload, register_inductor_fallback

__all__ = ["ensure_inductor_lowerings", "offload_op", "reload_op"]


@torch.library.custom_op("loom_offload::offload", mutates_args=())
def _offload(t: torch.Tensor, window_bytes: int) -> torch.Tensor:
    return transfers_for(t.device).offload(t, window_bytes)


@_offload.register_fake
def _offload_fake(t: torch.Tensor, window_bytes: int) -> torch.Tensor:
    stride = t.stride() if dense_span(t) is not None else None
    if stride is None:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device="cpu")


@torch.library.custom_op("loom_offload::reload", mutates_args=())
def _reload(host: torch.Tensor, device: torch.device, prefetch: list[torch.Tensor]) -> torch.Tensor:
    return transfers_for(device).reload(host, prefetch)


@_reload.register_fake
def _reload_fake(
    host: torch.Tensor, device: torch.device, prefetch: list[torch.Tensor]
) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


offload_op: OpOverload = torch.ops.loom_offload.offload.default
reload_op: OpOverload = torch.ops.loom_offload.reload.default

_register_offload = register_inductor_fallback(offload_op, protect_first_input=True)
_register_reload = register_inductor_fallback(reload_op, protect_first_input=False)


def ensure_inductor_lowerings() -> None:
    """Register both operators with Inductor (once; before a graph with them compiles)."""
    _register_offload()
    _register_reload()
