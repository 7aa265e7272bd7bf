"""``rewrite_fills_as_fsdp_copy``: on the Dynamo graph, fills of resized inputs
become ``fsdp.copy_`` (an in-place copy AOTAutograd keeps), other copies stay."""

from __future__ import annotations

import torch
from resize_testing import GraphBuilder, empty_param, fsdp_copy, targets

from loom_resize import rewrite_fills_as_fsdp_copy


def test_method_copy_into_resized_input_becomes_fsdp_copy() -> None:
    b = GraphBuilder()
    p = b.input("p", empty_param(4, 4), dynamo=True)
    src = b.input("src", torch.randn(4, 4), dynamo=True)
    b.resize(p, 64)
    b.graph.call_method("copy_", (p, src))
    gm = b.build(p)
    result = rewrite_fills_as_fsdp_copy(gm)
    assert result.modified and targets(gm).count(fsdp_copy()) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_method"]
    (new,) = [n for n in gm.graph.nodes if n.target is fsdp_copy()]
    assert new.meta["loom_pass"] == "rewrite_fills_as_fsdp_copy"
    param, data = empty_param(4, 4), torch.randn(4, 4)
    alias = param.view(16)
    gm(param, data)
    torch.testing.assert_close(alias, data.reshape(16))


def test_foreach_copy_is_split_between_resized_and_plain_destinations() -> None:
    b = GraphBuilder()
    p = b.input("p", empty_param(4, 4), dynamo=True)
    buf = b.input("buf", torch.randn(4, 4), dynamo=True)
    s1 = b.input("s1", torch.randn(4, 4), dynamo=True)
    s2 = b.input("s2", torch.randn(4, 4), dynamo=True)
    b.resize(p, 64)
    b.call(torch._foreach_copy_, [p, buf], [s1, s2])
    gm = b.build(p)
    result = rewrite_fills_as_fsdp_copy(gm)
    assert [c.where for c in result.changes] == ["input 'p'"]
    (foreach,) = [n for n in gm.graph.nodes if n.target is torch._foreach_copy_]
    assert foreach.args[0] == [buf] and foreach.args[1] == [s2]
    args = [empty_param(4, 4), torch.zeros(4, 4), torch.randn(4, 4), torch.randn(4, 4)]
    gm(*args)
    torch.testing.assert_close(args[0], args[2])
    torch.testing.assert_close(args[1], args[3])


def test_copy_into_an_input_that_is_never_resized_is_left_alone() -> None:
    b = GraphBuilder()
    buf = b.input("buf", torch.randn(4, 4), dynamo=True)
    src = b.input("src", torch.randn(4, 4), dynamo=True)
    b.graph.call_method("copy_", (buf, src))
    gm = b.build(buf)
    assert not rewrite_fills_as_fsdp_copy(gm).modified
