"""``move_shrinks_after_last_use``: an input freed in the graph is freed only
after its last read, and never earlier than the user freed it."""

from __future__ import annotations

import torch
from resize_testing import GraphBuilder, aten

from loom_resize import move_shrinks_after_last_use


def _shrink_graph(read_after: bool) -> torch.fx.GraphModule:
    b = GraphBuilder()
    p, x = b.input("p", torch.randn(4, 4)), b.input("x", torch.randn(2, 4))
    mm = b.call(aten.mm.default, x, p)
    b.resize(p, 0)
    outs = [mm]
    if read_after:
        view = b.call(aten.t.default, p)
        outs.append(b.call(aten.add.Tensor, view, 1))
    return b.build(*outs)


def test_resize_to_zero_moves_after_a_later_read_through_a_view() -> None:
    gm = _shrink_graph(read_after=True)
    result = move_shrinks_after_last_use(gm)
    assert result.modified
    order = [n.name for n in gm.graph.nodes]
    assert order.index("resize_storage_bytes__default") > order.index("add_tensor")
    p, x = torch.randn(4, 4), torch.randn(2, 4)
    q = p.clone()
    mm, added = gm(q, x)
    torch.testing.assert_close(mm, x @ p)
    torch.testing.assert_close(added, p.t() + 1)
    assert q.untyped_storage().nbytes() == 0
    assert "moved after add_tensor" in str(result.changes[0])


def test_resize_already_after_the_last_read_stays_put() -> None:
    gm = _shrink_graph(read_after=False)
    before = gm.code
    result = move_shrinks_after_last_use(gm)
    assert not result.modified and gm.code == before
    p, x = torch.randn(4, 4), torch.randn(2, 4)
    (mm,) = gm(p.clone(), x)
    torch.testing.assert_close(mm, x @ p)
