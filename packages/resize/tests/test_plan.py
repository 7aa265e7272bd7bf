"""The resize plan classifies each resized input and refuses unsound resizes."""

from __future__ import annotations

import pytest
import torch
from resize_testing import GraphBuilder, aten, empty_param, fsdp_copy

from loom_resize import ResizeCase, ResizeRefusalKind, ResizeRefused, plan_storage_resizes
from loom_resize._plan import STORAGE_NBYTES


def _up_down() -> GraphBuilder:
    b = GraphBuilder()
    p, src, x = (
        b.input("p", empty_param(4, 4)),
        b.input("src", torch.randn(4, 4)),
        b.input("x", torch.randn(2, 4)),
    )
    b.resize(p, 64)
    fill = b.call(fsdp_copy(), p, src)
    mm = b.call(aten.mm.default, x, p)
    b.resize(p, 0)
    b.out = mm  # type: ignore[attr-defined]
    b.fill = fill  # type: ignore[attr-defined]
    return b


def test_up_down_input_is_a_net_no_op() -> None:
    b = _up_down()
    plan = plan_storage_resizes(b.build(b.out))  # type: ignore[attr-defined]
    (info,) = plan.inputs
    assert (info.name, info.case, info.start_nbytes, info.end_nbytes) == (
        "p",
        ResizeCase.UP_DOWN,
        0,
        0,
    )
    assert info.fills == (b.fill.name,)  # type: ignore[attr-defined]


def test_input_resized_down_only_is_a_shrink() -> None:
    b = GraphBuilder()
    p, x = b.input("p", torch.randn(4, 4)), b.input("x", torch.randn(2, 4))
    mm = b.call(aten.mm.default, x, p)
    b.resize(p, 0)
    (info,) = plan_storage_resizes(b.build(mm)).inputs
    assert (info.case, info.start_nbytes, info.end_nbytes) == (ResizeCase.SHRINK, 64, 0)


def test_input_resized_up_and_filled_is_a_grow() -> None:
    b = GraphBuilder()
    p, src = b.input("p", empty_param(4, 4)), b.input("src", torch.randn(4, 4))
    b.resize(p, 64)
    b.call(aten.copy_.default, p, src)
    (info,) = plan_storage_resizes(b.build(p)).inputs
    assert (info.case, info.end_nbytes) == (ResizeCase.GROW, 64)


def test_recorded_storage_size_wins_over_inference() -> None:
    b = GraphBuilder()
    p = b.input("p", torch.randn(4, 4))
    p.meta[STORAGE_NBYTES] = 64
    b.resize(p, 0)
    b.resize(p, 64)
    (info,) = plan_storage_resizes(b.build(p)).inputs
    assert (info.case, info.start_nbytes) == (ResizeCase.DOWN_UP, 64)


def _refusal(gm: torch.fx.GraphModule) -> ResizeRefused:
    with pytest.raises(ResizeRefused) as info:
        plan_storage_resizes(gm)
    return info.value


def test_partial_resize_down_is_refused_naming_the_input() -> None:
    b = GraphBuilder()
    weight = b.input("weight", torch.randn(4, 4))
    weight.meta[STORAGE_NBYTES] = 64
    b.resize(weight, 32)
    err = _refusal(b.build(weight))
    assert err.reason.kind is ResizeRefusalKind.PARTIAL_RESIZE
    assert "input 'weight'" in err.reason.where and "from 64 to 32 bytes" in str(err)


def test_resize_up_to_fewer_bytes_than_needed_is_refused() -> None:
    b = GraphBuilder()
    weight = b.input("weight", empty_param(4, 4))
    b.resize(weight, 16)
    err = _refusal(b.build(weight))
    assert err.reason.kind is ResizeRefusalKind.PARTIAL_RESIZE
    assert "64 bytes the tensor needs" in str(err)


class _Marked(torch.Tensor):
    pass


def test_resize_of_tensor_subclass_is_refused() -> None:
    b = GraphBuilder()
    weight = b.input("weight", torch.randn(4, 4).as_subclass(_Marked))
    b.resize(weight, 0)
    err = _refusal(b.build(weight))
    assert err.reason.kind is ResizeRefusalKind.TENSOR_SUBCLASS
    assert "'weight'" in err.reason.where and "_Marked" in err.reason.explanation


def test_resize_of_intermediate_is_refused() -> None:
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 4))
    y = b.call(aten.mul.Tensor, x, 2)
    b.resize(y, 0)
    err = _refusal(b.build(x))
    assert err.reason.kind is ResizeRefusalKind.INTERMEDIATE
    assert f"node {y.name!r}" in err.reason.where and "graph inputs" in str(err)


def test_a_refusal_names_the_users_line_as_every_package_does() -> None:
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 4))
    y = b.call(aten.mul.Tensor, x, 2)
    resize = b.resize(y, 0)
    resize.meta["stack_trace"] = '  File "/user/train.py", line 9, in step\n    y.resize_(0)\n'
    err = _refusal(b.build(x))
    assert err.reason.where == f"node {y.name!r} at /user/train.py:9 in step"


def test_differentiable_fill_is_refused() -> None:
    b = GraphBuilder()
    p = b.input("p", empty_param(4, 4), dynamo=True)
    src = b.input("src", torch.randn(4, 4, requires_grad=True), dynamo=True)
    b.resize(p, 64)
    b.graph.call_method("copy_", (p, src))
    err = _refusal(b.build(p))
    assert err.reason.kind is ResizeRefusalKind.DIFFERENTIABLE_FILL
    assert "torch.no_grad()" in err.reason.hint


def test_fill_under_no_grad_is_accepted() -> None:
    b = GraphBuilder()
    p = b.input("p", empty_param(4, 4), dynamo=True)
    src = b.input("src", torch.randn(4, 4, requires_grad=True), dynamo=True)
    b.resize(p, 64)
    b.call(torch._C._set_grad_enabled, False)
    b.graph.call_method("copy_", (p, src))
    b.call(torch._C._set_grad_enabled, True)
    (info,) = plan_storage_resizes(b.build(p)).inputs
    assert info.case is ResizeCase.GROW


def test_refusal_kinds_are_told_apart_from_left_alone_reasons() -> None:
    assert {k for k in ResizeRefusalKind if k.is_refusal} == {
        ResizeRefusalKind.PARTIAL_RESIZE,
        ResizeRefusalKind.TENSOR_SUBCLASS,
        ResizeRefusalKind.INTERMEDIATE,
        ResizeRefusalKind.DIFFERENTIABLE_FILL,
    }


def test_item_of_a_list_input_counts_as_a_graph_input() -> None:
    import operator

    from loom_resize import record_input_storage

    b = GraphBuilder()
    inputs = b.graph.placeholder("inputs")
    weight = b.call(operator.getitem, inputs, 1)
    weight.meta["example_value"] = empty_param(4, 4)
    b.resize(weight, 64)
    b.resize(weight, 0)
    gm = b.build(weight)
    record_input_storage(gm, [[torch.randn(2), empty_param(4, 4)]])
    (info,) = plan_storage_resizes(gm).inputs
    assert (info.case, info.position, info.start_nbytes) == (ResizeCase.UP_DOWN, (0, 1), 0)
