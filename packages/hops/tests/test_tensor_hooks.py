"""order_intermediate_hooks: several register_hook hooks on one tensor run in eager order."""

from __future__ import annotations

from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import loom_hops
import loom_sidefx
from loom_hops._torch_compat import REGISTER_HOOK_HOP


def _backend(results: list[loom_sidefx.PassResult[torch.fx.GraphModule]]) -> Any:
    inner = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        results.append(loom_hops.order_intermediate_hooks(gm))
        return inner(gm, example_inputs)

    return backend


def _grad(fn: Any, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    fn(x).backward()
    assert x.grad is not None
    return x.grad


def test_two_hooks_on_one_tensor_run_in_registration_order() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.register_hook(lambda g: g * 2)
        y.register_hook(lambda g: g + 1)
        y.register_hook(lambda g: g.clamp(max=0.5))
        return (y.cos() + y * 3).sum()

    x = torch.randn(7)
    results: list[loom_sidefx.PassResult[torch.fx.GraphModule]] = []
    got = _grad(torch.compile(fn, backend=_backend(results), fullgraph=True), x)
    torch.testing.assert_close(got, _grad(fn, x))
    (result,) = results
    marked = [n for n in result.graph_module.graph.nodes if n.meta.get("loom_pass")]
    if REGISTER_HOOK_HOP:
        # torch >= 2.13: one register_hook HOP per hook, already in eager order.
        hops = [n for n in result.graph_module.graph.nodes if "register_hook" in str(n.target)]
        assert len(hops) == 3
        assert not result.modified and not marked
    else:
        assert result.modified
        assert len(marked) == 3


def test_single_hooks_and_hooks_on_different_tensors_are_left_alone() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.register_hook(lambda g: g * 2)
        z = y.exp()
        z.register_hook(lambda g: g + 1)
        return z.sum()

    x = torch.randn(5)
    results: list[loom_sidefx.PassResult[torch.fx.GraphModule]] = []
    got = _grad(torch.compile(fn, backend=_backend(results), fullgraph=True), x)
    torch.testing.assert_close(got, _grad(fn, x))
    assert [r.modified for r in results] == [False]
