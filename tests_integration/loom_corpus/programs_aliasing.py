"""Views, in-place ops, input mutation, outputs that alias inputs, buffer updates."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._program import Case, Program, gen, randn


def inplace_on_intermediates(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    h.add_(1.0)
    v = h.view(h.shape[0], 2, -1)
    v.mul_(0.5)
    t = h.t()
    t[0].sub_(h.sum(0)[:1])
    z = torch.sigmoid(h).unsqueeze(0)
    z = z.squeeze(0).clone()
    z.transpose_(0, 1)
    z.t_()
    return z + t.t()


def build_inplace_on_intermediates(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        inplace_on_intermediates,
        lambda i: (
            randn(6, 8, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            randn(8, 4, g=gen(50 + i), device=device, dtype=dtype, requires_grad=True),
        ),
    )


def mutate_input(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.add_(y)
    x.mul_(2.0)
    return x.sum(1) + y.mean()


def build_mutate_input(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        mutate_input,
        lambda i: (
            randn(5, 7, g=gen(i), device=device, dtype=dtype),
            randn(5, 7, g=gen(20 + i), device=device, dtype=dtype),
        ),
    )


def mutate_input_views(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x[:, 0].mul_(3.0)
    x.t()[1:3].add_(y.t()[1:3])
    x.view(-1)[::5].zero_()
    return x * y


def build_mutate_input_views(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        mutate_input_views,
        lambda i: (
            randn(4, 6, g=gen(i), device=device, dtype=dtype),
            randn(4, 6, g=gen(30 + i), device=device, dtype=dtype),
        ),
    )


def mutate_input_while_training(
    x: torch.Tensor, w: torch.Tensor, stats: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    y = torch.tanh(x @ w)
    stats.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
    count.add_(1)
    return y * stats


def build_mutate_input_while_training(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        mutate_input_while_training,
        lambda i: (
            randn(6, 5, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            randn(5, 3, g=gen(40 + i), device=device, dtype=dtype, requires_grad=True),
            randn(3, g=gen(60 + i), device=device, dtype=dtype),
            torch.zeros((), dtype=torch.int64, device=device),
        ),
    )


def aliased_inputs(base: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    row.mul_(2.0)  # `row` is a view of `base`: the write must show through `base`
    return base.sum(0) + row


def build_aliased_inputs(device: torch.device, dtype: torch.dtype) -> Case:
    def inputs(i: int) -> tuple[Any, ...]:
        base = randn(3, 4, g=gen(i), device=device, dtype=dtype)
        return base, base[1]

    return Case(aliased_inputs, inputs)


def return_views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x[1:], x.t(), x.view(-1), x.unsqueeze(0), x.sin(), x.diagonal()


def build_return_views(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        return_views,
        lambda i: (randn(4, 4, g=gen(i), device=device, dtype=dtype, requires_grad=True),),
    )


class RunningState(nn.Module):
    """Updates its own buffers in forward: an EMA of the input and a step counter."""

    ema: torch.Tensor
    steps: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.ema.lerp_(x.detach().mean(0), 0.25)
        return self.lin(x - self.ema)


def build_running_state(device: torch.device, dtype: torch.dtype) -> Case:
    model = RunningState().to(device=device, dtype=dtype)
    return Case(model, lambda i: (randn(5, 6, g=gen(i), device=device, dtype=dtype),))


def index_put_intermediate(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    h = x * 2.0
    h[idx] = h[idx] * 3.0 + 1.0
    h.index_add_(0, idx, x[: idx.shape[0]])
    return h.sum(1)


def build_index_put(device: torch.device, dtype: torch.dtype) -> Case:
    return Case(
        index_put_intermediate,
        lambda i: (
            randn(8, 3, g=gen(i), device=device, dtype=dtype, requires_grad=True),
            torch.randperm(8, generator=gen(70 + i))[:3].to(device),
        ),
    )


PROGRAMS: tuple[Program, ...] = (
    Program(
        "inplace_on_intermediates",
        build_inplace_on_intermediates,
        train=True,
        description="in-place ops through views and transposes of intermediates",
    ),
    Program(
        "mutate_input",
        build_mutate_input,
        description="in-place add_/mul_ on an input; the caller must see the change",
    ),
    Program(
        "mutate_input_views",
        build_mutate_input_views,
        description="in-place writes through a column, a transposed slice and a strided view",
    ),
    Program(
        "mutate_input_while_training",
        build_mutate_input_while_training,
        train=True,
        calls=3,
        description="running statistics and an int64 counter mutated in a training step",
    ),
    Program(
        "aliased_inputs",
        build_aliased_inputs,
        description="two inputs sharing storage (a tensor and its row); the row is mutated",
    ),
    Program(
        "return_views_of_input",
        build_return_views,
        train=True,
        description="outputs that are views of the input, next to a computed output",
    ),
    Program(
        "module_buffers_updated_in_forward",
        build_running_state,
        train=True,
        calls=3,
        description="module buffers (an EMA, a step counter) updated in place in forward",
    ),
    Program(
        "index_put_on_intermediate",
        build_index_put,
        train=True,
        description="advanced-index assignment and index_add_ with int64 indices",
    ),
)
