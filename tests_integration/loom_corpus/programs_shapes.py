"""Dynamic shapes and recompiles, Python scalars, integer tensors, several outputs,
gradient accumulation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._program import Case, Program, gen, randint, randn
from .programs_nets import MLP, build_mlp


def build_mlp_batches(sizes: tuple[int, ...]) -> Any:
    def build(device: torch.device, dtype: torch.dtype) -> Case:
        model = MLP().to(device=device, dtype=dtype)
        return Case(
            model,
            lambda i: (
                randn(sizes[i], 32, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            ),
        )

    return build


def scaled(x: torch.Tensor, alpha: float, n: int, flip: bool) -> torch.Tensor:
    # NOTE: not x.pow(n): with n symbolic, AOTAutograd's pow backward hits
    # "NYI SymInt equality" in torch 2.11 (aot_eager too).
    y = torch.sin(x * alpha) + x / (n + 1) + alpha * n
    return -y if flip else y


def build_scalars(device: torch.device, dtype: torch.dtype) -> Case:
    alphas = (0.5, 1.5, -2.0)
    powers = (2, 3, 5)
    flips = (False, False, True)
    return Case(
        scaled,
        lambda i: (
            randn(4, 5, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            alphas[i],
            powers[i],
            flips[i],
        ),
    )


def integer_ops(
    a: torch.Tensor, b: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    s = (a * 3 + b) // 2 % 7
    bits = (a & 5) | (b ^ 3)
    order = x.argsort(dim=1)
    picked = torch.gather(x, 1, order[:, :2]) * s[:, :2].to(x.dtype)
    return s.cumsum(0), bits << 1, order, picked


def build_integer_ops(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        integer_ops,
        lambda i: (
            randint(100, 4, 6, g=gen(i), device=device),
            randint(100, 4, 6, g=gen(10 + i), device=device, dtype=torch.int32),
            randn(4, 6, g=gen(20 + i), device=device, dtype=dtype, requires_grad=True),
        ),
    )


class Heads(nn.Module):
    """Several outputs in a nested structure, with a Python int and a None among them."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(10, 12)
        self.cls = nn.Linear(12, 3)
        self.reg = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = F.silu(self.trunk(x))
        logits = self.cls(h)
        return {
            "logits": logits,
            "probs": logits.softmax(-1),
            "pair": (self.reg(h).squeeze(-1), h.detach()),
            "batch": x.shape[0],
            "extra": None,
        }


def build_heads(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        Heads().to(device=device, dtype=dtype),
        lambda i: (randn(7, 10, g=gen(i), device=device, dtype=dtype, requires_grad=True),),
    )


PROGRAMS: tuple[Program, ...] = (
    Program(
        "dynamic_true_batch_sizes",
        build_mlp_batches((4, 7, 12)),
        train=True,
        calls=3,
        dynamic=True,
        expected_graphs=1,
        description="dynamic=True: one graph serves three batch sizes",
    ),
    Program(
        "static_size_change_recompiles",
        build_mlp_batches((4, 6, 4)),
        train=True,
        calls=3,
        dynamic=False,
        expected_graphs=2,
        description="dynamic=False: a new batch size compiles a second graph, the old one is reused",
    ),
    Program(
        "automatic_dynamic_after_size_change",
        build_mlp_batches((4, 6, 9)),
        train=True,
        calls=3,
        expected_graphs=2,
        description="default dynamic: a size change recompiles once with a symbolic batch",
    ),
    Program(
        "python_scalars_change",
        build_scalars,
        train=True,
        calls=3,
        description="a float, an int and a bool argument that change between calls",
    ),
    Program(
        "integer_tensor_ops",
        build_integer_ops,
        train=True,
        description="int64/int32 arithmetic, bit ops, argsort and gather",
    ),
    Program(
        "several_outputs",
        build_heads,
        train=True,
        description="a dict of tensors, a nested tuple, a Python int and None",
    ),
    Program(
        "gradient_accumulation",
        lambda d, t: build_mlp(d, t, grad_input=True),
        train=True,
        calls=4,
        accumulate_grads=True,
        description="four forward/backward calls accumulating into .grad",
    ),
)
