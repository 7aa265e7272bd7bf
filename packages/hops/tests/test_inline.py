"""inline_subgraph_hops: the HOP boundary disappears at codegen, the numbers do not change."""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from loom_hops import SubgraphHOP, inline_subgraph_hops, pack_hook_op


def _traced_with_hop() -> torch.fx.GraphModule:
    const = torch.tensor([1.0, 2.0, 3.0])
    sub = make_fx(lambda x: (x * const, x.sum()))(torch.randn(3))

    def f(x: torch.Tensor) -> torch.Tensor:
        a, b = pack_hook_op(sub, x + 1)
        return a * b

    return make_fx(f)(torch.randn(3))


def test_inlining_removes_every_subgraph_call_and_keeps_results() -> None:
    gm = _traced_with_hop()
    x = torch.randn(3)
    before = gm(x)
    result = inline_subgraph_hops(gm)
    assert result.modified and result.graph_module is gm
    assert not any(isinstance(n.target, SubgraphHOP) for n in gm.graph.nodes)
    assert not any(isinstance(m, torch.fx.GraphModule) for m in gm.children())
    torch.testing.assert_close(gm(x), before)


def test_inlined_nodes_are_marked_with_the_pass() -> None:
    gm = _traced_with_hop()
    inline_subgraph_hops(gm)
    marked = [n for n in gm.graph.nodes if n.meta.get("loom_pass") == "inline_subgraph_hops"]
    assert any(n.op == "call_function" for n in marked)


def test_a_graph_without_hops_is_left_unchanged() -> None:
    gm = make_fx(lambda x: x.sin())(torch.randn(2))
    code = gm.code
    result = inline_subgraph_hops(gm)
    assert not result.modified and gm.code == code
