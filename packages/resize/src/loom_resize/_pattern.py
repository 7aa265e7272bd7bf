"""A single-process model of FSDP2's parameter lifecycle, for tests and benchmarks.

Each layer keeps its weight as a parameter with **zero storage** plus a
"shard" holding the data. Forward gathers (a copy of the shard stands in for
the all-gather), resizes the weight's storage up, fills it, uses it, and
resizes it back to zero. Backward is prepared by :meth:`FSDPPatternStack.prepare_backward`:
a hook on the output gathers every weight again before the compiled backward
reads them, and each weight is freed again once its gradient is accumulated.
With ``reduce_grads=True`` that post-accumulate-grad hook first reduces the full
gradient into a persistent gradient shard (an add stands in for FSDP2's
reduce-scatter) and drops it, so no full gradient outlives its layer's backward.
Eager and compiled runs follow the same protocol, so they can be compared in
outputs, gradients and storage sizes.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from loom_resize import _torch_compat as compat

__all__ = ["FSDPPatternStack", "FillOp"]

FillOp = Literal["fsdp", "copy", "foreach"]


class FSDPPatternStack(nn.Module):
    """``num_layers`` linear layers of ``dim x dim`` with FSDP-style weights.

    >>> model = FSDPPatternStack(2, 8)
    >>> out = model(torch.randn(4, 8, requires_grad=True))
    >>> model.prepare_backward(out)
    >>> out.sum().backward()
    >>> model.storage_nbytes()
    [0, 0]

    With ``reduce_grads=True`` the gradients land in ``grad_shard(i)`` instead of
    ``weights[i].grad``, which is ``None`` after backward.
    """

    def __init__(
        self,
        num_layers: int,
        dim: int,
        *,
        fill: FillOp = "fsdp",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        reduce_grads: bool = False,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fill = fill
        self.reduce_grads = reduce_grads
        self._copy_op = compat.fsdp_copy()
        self.weights = nn.ParameterList()
        shards = []
        for _ in range(num_layers):
            data = (torch.randn(dim, dim, generator=gen) / dim**0.5).to(device, dtype)
            weight = nn.Parameter(torch.empty_like(data))
            weight.untyped_storage().resize_(0)
            self.weights.append(weight)
            shards.append(data)
        for i, shard in enumerate(shards):
            self.register_buffer(f"shard{i}", shard)
            if reduce_grads:
                self.register_buffer(f"grad_shard{i}", torch.zeros_like(shard))

    def shard(self, i: int) -> torch.Tensor:
        buf = getattr(self, f"shard{i}")
        assert isinstance(buf, torch.Tensor)
        return buf

    def grad_shard(self, i: int) -> torch.Tensor:
        """Layer ``i``'s reduced gradient, summed over steps (``reduce_grads=True``)."""
        buf = getattr(self, f"grad_shard{i}")
        assert isinstance(buf, torch.Tensor)
        return buf

    def _gather(self, i: int) -> None:
        weight = self.weights[i]
        gathered = self.shard(i) * 1  # the all-gather output: a fresh full buffer
        with torch.no_grad(), compat.preserve_version_counter(weight):
            weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            if self.fill == "fsdp":
                self._copy_op(weight, gathered)
            elif self.fill == "copy":
                weight.copy_(gathered)
            else:
                compat.foreach_copy_([weight], [gathered])

    def _free(self, i: int) -> None:
        self.weights[i].untyped_storage().resize_(0)

    def _after_accumulate(self, weight: torch.Tensor, i: int) -> None:
        if self.reduce_grads:
            grad = weight.grad
            assert grad is not None
            with torch.no_grad():
                self.grad_shard(i).add_(grad)  # the reduce-scatter
            weight.grad = None
        self._free(i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, weight in enumerate(self.weights):
            self._gather(i)
            x = torch.relu(x @ weight.t())
            self._free(i)
        return x

    def prepare_backward(self, out: torch.Tensor) -> None:
        """Gather every weight when ``out``'s gradient arrives; free each after
        its gradient is accumulated (reducing the gradient first with
        ``reduce_grads``). Call outside the compiled region."""

        def gather_all(grad: torch.Tensor) -> torch.Tensor:
            for i in range(len(self.weights)):
                self._gather(i)
            return grad

        out.register_hook(gather_all)  # type: ignore[no-untyped-call]
        for i, weight in enumerate(self.weights):
            if not getattr(weight, "_loom_free_hook", False):
                weight.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._after_accumulate(p, i)
                )
                weight._loom_free_hook = True  # type: ignore[attr-defined]

    def storage_nbytes(self) -> list[int]:
        return [int(w.untyped_storage().nbytes()) for w in self.weights]
