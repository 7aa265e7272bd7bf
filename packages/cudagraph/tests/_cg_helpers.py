"""Tracing helpers shared by the CPU tests: aten graphs with fake CUDA tensors
(for plans) or real CPU tensors (for the runtime with HostCapturer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from loom_cudagraph import CudagraphOptions, PartitionPlan, plan_graph


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def fake_inputs(*specs: tuple[tuple[int, ...], str]) -> tuple[Any, list[torch.Tensor]]:
    mode = fake_mode()
    with mode:
        return mode, [torch.empty(shape, device=device) for shape, device in specs]


def trace_fake(
    fn: Callable[..., Any], *specs: tuple[tuple[int, ...], str]
) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``fn`` as an aten graph over fake tensors of the given shapes and devices."""
    _, inputs = fake_inputs(*specs)
    gm = make_fx(fn, tracing_mode="fake", record_stack_traces=True)(*inputs)
    return gm, inputs


def trace_real(fn: Callable[..., Any], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="real", record_stack_traces=True)(*inputs)


def plan_of(
    fn: Callable[..., Any],
    *specs: tuple[tuple[int, ...], str],
    static: Sequence[int] = (),
    **options: Any,
) -> PartitionPlan:
    gm, inputs = trace_fake(fn, *specs)
    return plan_graph(gm, inputs, static, CudagraphOptions(**options), name="test")


CUDA = "cuda"

#: Fake CUDA tensors can be made on any build, but ops that dispatch to the CUDA
#: backend while tracing (``.cuda()``, CUDA factories, device copies) need a torch
#: built with CUDA; the CPU-only wheels (``+cpu``) raise "not linked with support
#: for cuda devices". A property of the wheel, not of the release or the machine.
needs_cuda_build = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason="traces CUDA ops on fake tensors: needs a CUDA build of torch (this one is CPU-only)",
)
