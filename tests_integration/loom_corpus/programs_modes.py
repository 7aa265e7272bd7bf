"""Grad modes, autocast, seeded dropout, graph breaks, mixed requires_grad."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._program import Case, Program, Tolerance, gen, randn
from .programs_nets import build_mlp


def _no_grad(device: torch.device) -> AbstractContextManager[Any]:
    return torch.no_grad()


def _inference_mode(device: torch.device) -> AbstractContextManager[Any]:
    return torch.inference_mode()


def _autocast_bf16(device: torch.device) -> AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def partly_no_grad(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x @ w
    with torch.no_grad():
        scale = h.abs().amax(dim=1, keepdim=True) + 1.0
        frozen = h * 2.0
    return h / scale, frozen


def build_partly_no_grad(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        partly_no_grad,
        lambda i: (
            randn(5, 4, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            randn(4, 3, g=gen(10 + i), device=device, dtype=dtype, requires_grad=True),
        ),
    )


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(F.dropout(h, p=0.1, training=self.training))


def build_dropout(device: torch.device, dtype: torch.dtype) -> Case:
    model = DropoutNet().to(device=device, dtype=dtype)
    return Case(model, lambda i: (randn(8, 16, g=gen(i), device=device, dtype=dtype),))


class BreakInTheMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h * 2.0)


def build_graph_break(device: torch.device, dtype: torch.dtype) -> Case:
    model = BreakInTheMiddle().to(device=device, dtype=dtype)
    return Case(
        model,
        lambda i: (randn(3, 8, g=gen(i), device=device, dtype=dtype, requires_grad=True),),
    )


class PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.trained(self.frozen(x) * y + z)


def build_mixed_requires_grad(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        PartlyFrozen().to(device=device, dtype=dtype),
        lambda i: (
            randn(4, 6, g=gen(i), device=device, dtype=dtype),
            randn(4, 6, g=gen(10 + i), device=device, dtype=dtype, requires_grad=True),
            randn(4, 6, g=gen(20 + i), device=device, dtype=dtype),
        ),
    )


PROGRAMS: tuple[Program, ...] = (
    Program(
        "no_grad_context",
        lambda d, t: build_mlp(d, t, grad_input=True),
        context=_no_grad,
        description="a module with trainable parameters called under torch.no_grad()",
    ),
    Program(
        "no_grad_region_inside",
        build_partly_no_grad,
        train=True,
        description="a torch.no_grad() block inside the compiled function",
    ),
    Program(
        "inference_mode_context",
        build_mlp,
        context=_inference_mode,
        description="a module called under torch.inference_mode()",
    ),
    Program(
        "autocast_bf16_train",
        lambda d, t: build_mlp(d, t, grad_input=True),
        train=True,
        context=_autocast_bf16,
        # float32 gradients flow through bfloat16 matmuls
        tolerances={torch.float32: Tolerance(5e-2, 5e-2), torch.bfloat16: Tolerance(5e-2, 5e-2)},
        description="float32 MLP under torch.autocast(bfloat16), backward outside it",
    ),
    Program(
        "dropout_seeded_train",
        build_dropout,
        train=True,
        calls=3,
        seeded=True,
        description="nn.Dropout and F.dropout with torch.manual_seed before each call",
    ),
    Program(
        "graph_break_in_the_middle",
        build_graph_break,
        train=True,
        expected_graphs=2,
        description="torch._dynamo.graph_break() between two layers: two graphs",
    ),
    Program(
        "mixed_requires_grad",
        build_mixed_requires_grad,
        train=True,
        description="a frozen submodule and inputs of which only one requires grad",
    ),
)
