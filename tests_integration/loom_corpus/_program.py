"""A corpus program: a small model or function, how to feed it, what to compare.

A :class:`Program` is plain data plus a ``build`` function. ``build(device,
dtype)`` returns a :class:`Case`: the callable (an ``nn.Module`` or a function)
and an input factory ``inputs(call_index) -> tuple`` that returns *fresh*,
deterministic arguments for each call. The differential runner calls ``build``
and the factory once per side (eager and compiled) under the same seed, so
both sides start from identical parameters and identical inputs, aliasing
between inputs included.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = [
    "DEFAULT_TOLERANCES",
    "Case",
    "Program",
    "Tolerance",
    "gen",
    "randint",
    "randn",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Tolerance:
    """``torch.testing.assert_close`` bounds for one dtype."""

    atol: float
    rtol: float


#: Per-dtype bounds for outputs, buffers and gradients; integers compare exactly.
#: The float32 bounds leave room for Inductor's reordered reductions.
DEFAULT_TOLERANCES: Mapping[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.float16: Tolerance(2e-3, 2e-3),
    torch.bfloat16: Tolerance(3e-2, 3e-2),
}

Inputs = Callable[[int], tuple[Any, ...]]
Context = Callable[[torch.device], AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """What ``Program.build`` returns: the callable and its per-call input factory."""

    fn: Callable[..., Any]
    inputs: Inputs


def _no_context(device: torch.device) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """One corpus entry.

    ``train``: put a module in train mode and backpropagate a weighted sum of
    the outputs after every call, then compare parameter and input gradients.
    ``calls``: how many calls, each with ``inputs(i)``. ``accumulate_grads``:
    keep ``.grad`` across calls instead of clearing it. ``seeded``: call
    ``torch.manual_seed`` before each call on both sides (dropout).
    ``context``: a context manager wrapped around each forward call on both
    sides (``torch.no_grad``, autocast). ``dynamic``: ``torch.compile(dynamic=)``.
    ``expected_graphs``: the number of distinct graphs Dynamo must have
    compiled after the last call (recompiles and graph breaks), or ``None``.
    """

    name: str
    build: Callable[[torch.device, torch.dtype], Case]
    train: bool = False
    calls: int = 2
    dtype: torch.dtype = torch.float32
    accumulate_grads: bool = False
    seeded: bool = False
    context: Context = _no_context
    dynamic: bool | None = None
    expected_graphs: int | None = None
    tolerances: Mapping[torch.dtype, Tolerance] = dataclasses.field(default_factory=dict)
    description: str = ""

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """Bounds for tensors of ``dtype``: exact for integers and bool."""
        if not (dtype.is_floating_point or dtype.is_complex):
            return Tolerance(0.0, 0.0)
        merged = {**DEFAULT_TOLERANCES, **self.tolerances}
        return merged.get(dtype, DEFAULT_TOLERANCES[torch.float32])


def gen(seed: int) -> torch.Generator:
    """A CPU generator: values are drawn on CPU then moved, so every device sees the same."""
    return torch.Generator().manual_seed(seed)


def randn(
    *shape: int,
    g: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> torch.Tensor:
    """A normal tensor drawn from ``g`` on CPU, moved to ``device`` as a leaf."""
    t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def randint(
    high: int,
    *shape: int,
    g: torch.Generator,
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Integers in ``[0, high)`` drawn from ``g`` on CPU, moved to ``device``."""
    return torch.randint(high, shape, generator=g).to(device=device, dtype=dtype)
