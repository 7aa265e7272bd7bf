"""torchloom.grad_hook end to end: gradient hooks with Python side effects, no graph break.

Each test runs a step three times (each call with its own hook closure and
sink), then the three backwards, under ``fullgraph=True``, and compares the
losses, the hooks' side effects (what they recorded, how often, in which order)
and the gradients with the same program written with ``Tensor.register_hook``
in eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchloom

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tapped_step(hook: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A small MLP step: two hooked tensors, hooks closing over per-call state."""

    def step(
        model: torch.nn.Module, x: torch.Tensor, sink: list[torch.Tensor], calls: list[int]
    ) -> torch.Tensor:
        h = model[0](x).relu()

        def record(g: torch.Tensor) -> None:
            sink.append(g.norm())
            calls.append(len(calls))

        h = hook(h, record, lambda g: g.clamp(-0.01, 0.01))
        out = hook(model[2](h), lambda g: sink.append(g.norm()))
        return out.square().mean()

    return step


def _register_hook(y: torch.Tensor, *fns: Callable[..., Any]) -> torch.Tensor:
    y = y.clone()
    for fn in fns:
        y.register_hook(fn)
    return y


def _grad_hook_run(step: Callable[..., torch.Tensor], device: str) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.to(device)
    xs = [torch.randn(8, 16, device=device) for _ in range(3)]
    sinks: list[list[torch.Tensor]] = [[], [], []]
    calls: list[int] = []
    losses = [step(model, x, sink, calls) for x, sink in zip(xs, sinks, strict=True)]
    for loss in reversed(losses):
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    return [loss.detach() for loss in losses], sinks, calls, grads


def _check_grad_hook(device: str, options: dict[str, Any]) -> None:
    """Also: the backward is compiled at the first backward, when the hooks are known,
    and they are inlined, with the cache on (the default; the entry is stored after
    that compile) or off."""
    torchloom.reset()
    compiled = torch.compile(
        _tapped_step(torchloom.grad_hook), backend="loom", fullgraph=True, options=options
    )
    got = _grad_hook_run(compiled, device)
    want = _grad_hook_run(_tapped_step(_register_hook), device)
    torch.testing.assert_close(got[0], want[0])
    assert [len(s) for s in got[1]] == [2, 2, 2]
    torch.testing.assert_close(got[1], want[1])
    assert got[2] == want[2] == [0, 1, 2]
    torch.testing.assert_close(got[3], want[3])
    kinds = {e.kind for e in torchloom.report().entries("grad_hooks")}
    assert kinds == {"inlined"}


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_grad_hook_with_side_effects_matches_register_hook_under_fullgraph(cache: bool) -> None:
    _check_grad_hook("cpu", {"codegen": "eager", "cache": cache})


@pytest.mark.inductor
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_grad_hook_with_side_effects_with_inductor_on_cpu(cache: bool) -> None:
    _check_grad_hook("cpu", {"cache": cache})


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "options",
    [{}, {"cache": False}, {"cudagraphs": True}, {"cudagraphs": True, "cache": False}],
    ids=["inductor", "inductor-inlined", "inductor-cudagraphs", "inductor-cudagraphs-inlined"],
)
def test_grad_hook_with_side_effects_on_gpu(options: dict[str, Any]) -> None:
    _check_grad_hook("cuda", options)
