"""SubgraphHOP: one operator whose rules (eager, fake, proxy, functional, autograd) are written once."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import loom_hops
from loom_hops import SubgraphHOP


class _Differentiable(SubgraphHOP):
    differentiable = True


class _Opaque(SubgraphHOP):
    differentiable = False


diff_op = _Differentiable("loom_test_differentiable")
opaque_op = _Opaque("loom_test_opaque")


def _sub(fn: object) -> torch.fx.GraphModule:
    return make_fx(fn)(torch.randn(3, 4))  # type: ignore[arg-type]


def test_eager_call_equals_running_the_subgraph() -> None:
    sub = _sub(lambda x: (x.sin(), x.sum()))
    x = torch.randn(3, 4)
    got = opaque_op(sub, x)
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got[0], x.sin())
    torch.testing.assert_close(got[1], x.sum())


def test_fake_mode_propagates_metadata_without_computing() -> None:
    sub = _sub(lambda x: (x.to(torch.bfloat16).t(),))
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 4))
        (y,) = opaque_op(sub, x)
    assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (4, 3))


def test_make_fx_keeps_one_node_with_a_registered_subgraph() -> None:
    sub = _sub(lambda x: (x.cos() + 1,))

    def f(x: torch.Tensor) -> torch.Tensor:
        return opaque_op(sub, x * 2)[0]

    gm = make_fx(f)(torch.randn(3, 4))
    hops = [n for n in gm.graph.nodes if n.target is opaque_op]
    assert len(hops) == 1
    assert isinstance(getattr(gm, str(hops[0].args[0].target)), torch.fx.GraphModule)
    assert all(u.target is operator.getitem for u in hops[0].users)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), (x * 2).cos() + 1)


def test_functionalization_removes_mutations_inside_the_subgraph() -> None:
    def mutating(x: torch.Tensor) -> tuple[torch.Tensor]:
        y = x.clone()
        y.add_(1)
        return (y,)

    sub = make_fx(mutating)(torch.randn(3))

    def f(x: torch.Tensor) -> torch.Tensor:
        return opaque_op(sub, x)[0]

    gm = make_fx(torch.func.functionalize(f))(torch.randn(3))
    node = next(n for n in gm.graph.nodes if n.target is opaque_op)
    inner = getattr(gm, str(node.args[0].target))
    assert not any(str(n.target).endswith("add_.Tensor") for n in inner.graph.nodes)
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x + 1)


def test_non_differentiable_outputs_do_not_require_grad() -> None:
    sub = _sub(lambda x: (x * 3,))
    x = torch.randn(3, 4, requires_grad=True)
    (y,) = opaque_op(sub, x)
    assert not y.requires_grad
    torch.testing.assert_close(y, x.detach() * 3)


def test_differentiable_operator_passes_gradients_through_its_subgraph() -> None:
    sub = _sub(lambda x: (x.sin() * 3,))
    x = torch.randn(3, 4, requires_grad=True)
    (y,) = diff_op(sub, x)
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x.detach().cos() * 3)


def test_a_subgraph_must_be_a_graph_module() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.fx\.GraphModule"):
        opaque_op(lambda x: (x,), torch.randn(2))  # type: ignore[arg-type]


def test_names_are_unique_and_registered() -> None:
    with pytest.raises(ValueError, match="already exists"):
        _Opaque("loom_test_opaque")
    names = {op.name() for op in loom_hops.subgraph_hops()}
    assert {"loom_saved_tensor_pack", "loom_saved_tensor_unpack", "loom_test_opaque"} <= names
