"""Backward passes that keep the graph (``retain_graph``, ``create_graph``) through a
loom-compiled function equal eager's, with either codegen, cold and served from
loom's cache: the backward donates no saved tensor (``compat.keep_saved_tensors``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import torchloom

Fn = Callable[[torch.Tensor], torch.Tensor]
CODEGENS = ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torch._dynamo.reset()
    torchloom.reset()
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    # Tanh saves its output, an intermediate AOTAutograd would donate to the backward.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 4, requires_grad=True)


def _retained_passes(fn: Fn, model: torch.nn.Module) -> list[torch.Tensor]:
    """Every way of reading one forward's graph again: the gradients they give."""
    x = _x()
    out = fn(x)
    out.sum().backward(retain_graph=True)  # two backward passes over one forward
    out.pow(2).sum().backward()
    params = list(model.parameters())
    found = [x.grad, *(p.grad for p in params)]
    out = fn(x)
    first = torch.autograd.grad(out[:, 0].sum(), params, retain_graph=True)  # two losses
    second = torch.autograd.grad(out[:, 1].sum(), params)
    (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)  # a penalty's first half
    jacobian = torch.autograd.functional.jacobian(fn, x.detach())
    assert isinstance(jacobian, torch.Tensor)
    return [*found, *first, *second, gx, jacobian]  # type: ignore[list-item]


def _check_against_eager(codegen: str) -> None:
    eager = _model()
    reference = _retained_passes(eager, eager)
    model = _model()
    compiled = torch.compile(model, backend="loom", options={"codegen": codegen})
    for got, want in zip(_retained_passes(compiled, model), reference, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_retained_backward_passes_equal_eager_cold_and_served_from_the_cache(
    codegen: str,
) -> None:
    _check_against_eager(codegen)
    torch._dynamo.reset()
    torchloom.reset()
    _check_against_eager(codegen)  # the same graphs, now served from loom's cache
    assert any(e.kind == "hit" for e in torchloom.report().entries("cache"))


def test_a_second_order_backward_is_pytorchs_own_refusal_as_under_aot_eager() -> None:
    """Differentiating the backward itself (a gradient penalty's ``penalty.backward()``)
    is refused by AOTAutograd for every backend built on it: loom says what aot_eager says."""
    messages = []
    for backend, kwargs in (("aot_eager", {}), ("loom", {"options": {"codegen": "eager"}})):
        torch._dynamo.reset()
        fn = torch.compile(_model(), backend=backend, **kwargs)
        x = _x()
        (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="does not currently support double backward") as e:
            gx.pow(2).sum().backward()
        messages.append(str(e.value))
    assert messages[0] == messages[1]
