"""The benchmark workloads: which model, which input, which step.

The models and their sizes come from ``torchloom._models`` (the same ones
``torchloom demo`` runs), so the demo and the benchmarks measure the same
shapes. A :class:`Workload` builds a fresh model and input on a device and
gives the step to time: a training step (forward, a scalar loss, backward,
gradients cleared first) or an inference call under ``torch.no_grad``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from torchloom._models import MLP, GPTStack, ModelSize

__all__ = ["QUICK_SIZE", "Workload", "size_for", "step", "workloads"]

#: ``--quick`` sizes: small enough for a CPU Inductor compile to take seconds.
QUICK_SIZE = ModelSize(width=64, depth=1, heads=4, seq=16, batch=8)


def size_for(device: torch.device, quick: bool) -> ModelSize:
    """The demo's size for ``device``, or :data:`QUICK_SIZE` for smoke runs."""
    return QUICK_SIZE if quick else ModelSize.for_device(device)


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """One measured workload: ``build`` returns a model and its input on a device."""

    name: str
    train: bool
    build_model: Callable[[ModelSize], nn.Module]
    input_shape: Callable[[ModelSize], tuple[int, ...]]

    def build(self, size: ModelSize, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = self.build_model(size).to(device).train(self.train)
        x = torch.randn(self.input_shape(size), generator=torch.Generator().manual_seed(1))
        return model, x.to(device)


def step(
    model: Callable[[torch.Tensor], torch.Tensor],
    params: list[nn.Parameter],
    x: torch.Tensor,
    train: bool,
) -> torch.Tensor:
    """One timed step; returns the output (detached for training steps)."""
    if not train:
        with torch.no_grad():
            return model(x)
    for p in params:
        p.grad = None
    out = model(x)
    torch.autograd.backward(out.float().pow(2).mean())
    return out.detach()


def workloads() -> tuple[Workload, ...]:
    """Batch-8 MLP inference, MLP and GPT-stack training steps, batch-1 GPT inference."""
    return (
        Workload(
            "mlp_infer_b8", False, lambda s: MLP(s.width, s.depth * 2), lambda s: (8, s.width)
        ),
        Workload(
            "mlp_train", True, lambda s: MLP(s.width, s.depth * 2), lambda s: (s.batch, s.width)
        ),
        Workload(
            "gpt_train",
            True,
            lambda s: GPTStack(s.width, s.depth, s.heads),
            lambda s: (s.batch, s.seq, s.width),
        ),
        Workload(
            "gpt_infer_b1",
            False,
            lambda s: GPTStack(s.width, s.depth, s.heads),
            lambda s: (1, s.seq, s.width),
        ),
    )
