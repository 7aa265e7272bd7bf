"""``remove_resize_copy_resize``: uses between the fill and the resize to 0 read
the fill's source, the three mutations go, and what is returned (saved for
backward) stays the original zero-storage input. Each case checks the graph
and runs it against the unchanged graph on real tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from resize_testing import RESIZE, GraphBuilder, aten, empty_param, fsdp_copy, targets
from torch.fx import GraphModule

from loom_resize import ResizeRefusalKind, remove_resize_copy_resize

Fill = Callable[[GraphBuilder, torch.fx.Node, torch.fx.Node], Any]

FILLS: dict[str, Fill] = {
    "fsdp.copy_": lambda b, p, s: b.call(fsdp_copy(), p, s),
    "aten.copy_": lambda b, p, s: b.call(aten.copy_.default, p, s),
    "aten._foreach_copy_": lambda b, p, s: b.call(aten._foreach_copy_.default, [p], [s]),
}


def _inputs(src: torch.Tensor | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [
        empty_param(4, 4),
        torch.randn(4, 4, generator=gen) if src is None else src,
        torch.randn(2, 4, generator=gen),
    ]


def _run(gm: GraphModule, inputs: list[torch.Tensor]) -> tuple[Any, list[int]]:
    args = [t.clone() if t.untyped_storage().nbytes() else empty_param(*t.shape) for t in inputs]
    out = gm(*args)
    return out, [a.untyped_storage().nbytes() for a in args]


def _up_down(
    fill: Fill, src_value: torch.Tensor | None = None
) -> tuple[GraphModule, list[torch.Tensor]]:
    inputs = _inputs(src_value)
    b = GraphBuilder()
    p, src, x = b.inputs(("p", "src", "x"), inputs)
    b.resize(p, 64)
    fill(b, p, src)
    mm = b.call(aten.mm.default, x, p)
    relu = b.call(aten.relu.default, mm)
    b.resize(p, 0)
    return b.build(relu, p), inputs


@pytest.mark.parametrize("fill", sorted(FILLS))
def test_chain_uses_read_the_copy_source_and_the_mutations_go(fill: str) -> None:
    gm, inputs = _up_down(FILLS[fill])
    (want, _), want_sizes = _run(gm, inputs)
    result = remove_resize_copy_resize(gm)
    assert result.modified and not result.left_alone
    assert RESIZE not in targets(gm) and fsdp_copy() not in targets(gm)
    assert "torch.ops.aten.mm.default(x, src)" in gm.code
    (got, got_p), got_sizes = _run(gm, inputs)
    torch.testing.assert_close(got, want)
    assert got_sizes == want_sizes and got_sizes[0] == 0
    assert got_p.untyped_storage().nbytes() == 0  # what backward would see: the empty input
    assert "1 chain(s), 1 use(s) read src" in str(result.changes[0])
    assert any(n.meta.get("loom_pass") == "remove_resize_copy_resize" for n in gm.graph.nodes)


def _freed_then_read(view_only: bool) -> tuple[GraphModule, list[torch.Tensor]]:
    """The compiled-autograd backward's shape: the free (a post-accumulate-grad
    hook) comes right after one gradient, and the weight is read again after it."""
    inputs = _inputs()
    b = GraphBuilder()
    p, src, x = b.inputs(("p", "src", "x"), inputs)
    b.resize(p, 64)
    b.call(aten.copy_.default, p, src)
    first = b.call(aten.mm.default, x, p)
    b.resize(p, 0)
    pt = b.call(aten.t.default, b.call(aten.t.default, p))
    if view_only:
        return b.build(first, pt), inputs
    return b.build(first, b.call(aten.mm.default, x, pt), p), inputs


def test_data_read_after_the_free_reads_the_source_too() -> None:
    gm, (p, src, x) = _freed_then_read(view_only=False)
    result = remove_resize_copy_resize(gm)
    assert result.modified and not result.left_alone
    assert RESIZE not in targets(gm)
    assert "torch.ops.aten.t.default(src)" in gm.code
    assert "1 read(s) after its resize to 0 (freed storage)" in str(result.changes[0])
    (first, second, got_p), sizes = _run(gm, [p, src, x])
    torch.testing.assert_close(first, x @ src)
    torch.testing.assert_close(second, x @ src)
    assert sizes[0] == 0 and got_p.untyped_storage().nbytes() == 0


def test_views_after_the_free_keep_reading_the_input() -> None:
    gm, _ = _freed_then_read(view_only=True)
    result = remove_resize_copy_resize(gm)
    assert result.modified and "after its resize to 0" not in str(result.changes[0])
    assert "torch.ops.aten.t.default(p)" in gm.code


def test_repeated_chains_on_one_input_each_read_their_own_source() -> None:
    gen = torch.Generator().manual_seed(5)
    inputs = [
        empty_param(4, 4),
        torch.randn(4, 4, generator=gen),
        torch.randn(4, 4, generator=gen),
        torch.randn(2, 4, generator=gen),
    ]
    b = GraphBuilder()
    p, s1, s2, x = b.inputs(("p", "s1", "s2", "x"), inputs)
    h = x
    for src in (s1, s2):
        b.resize(p, 64)
        b.call(fsdp_copy(), p, src)
        h = b.call(aten.mm.default, h, p)
        b.resize(p, 0)
    gm = b.build(h)
    want, _ = _run(gm, inputs)
    result = remove_resize_copy_resize(gm)
    assert "2 chain(s), 2 use(s) read s1, s2" in str(result.changes[0])
    got, sizes = _run(gm, inputs)
    torch.testing.assert_close(got, want)
    assert sizes[0] == 0


@pytest.mark.parametrize(
    "src_value,detail",
    [
        (torch.randn(4, 4).t(), "stride"),
        (torch.randn(4, 4, dtype=torch.float64), "dtype"),
    ],
)
def test_source_with_other_metadata_leaves_the_chain_alone(
    src_value: torch.Tensor, detail: str
) -> None:
    gm, inputs = _up_down(FILLS["fsdp.copy_"], src_value)
    before = gm.code
    (want, _), _ = _run(gm, inputs)
    result = remove_resize_copy_resize(gm)
    assert not result.modified and gm.code == before
    (reason,) = result.left_alone
    assert reason.kind is ResizeRefusalKind.METADATA_MISMATCH and detail in reason.explanation
    assert "'p'" in reason.where
    (got, _), _ = _run(gm, inputs)
    torch.testing.assert_close(got, want)


def _chain_with(extra: Callable[[GraphBuilder, torch.fx.Node], Any]) -> GraphModule:
    b = GraphBuilder()
    p, src, x = b.inputs(("p", "src", "x"), _inputs())
    b.resize(p, 64)
    b.call(fsdp_copy(), p, src)
    out = extra(b, p)
    mm = b.call(aten.mm.default, x, p)
    b.resize(p, 0)
    return b.build(mm, *([out] if out is not None else []))


def test_view_returned_for_backward_leaves_the_chain_alone() -> None:
    gm = _chain_with(lambda b, p: b.call(aten.t.default, p))
    result = remove_resize_copy_resize(gm)
    (reason,) = result.left_alone
    assert reason.kind is ResizeRefusalKind.VIEW_ESCAPES and not result.modified


def test_view_of_a_view_returned_for_backward_leaves_the_chain_alone() -> None:
    def nested(b: GraphBuilder, p: torch.fx.Node) -> torch.fx.Node:
        return b.call(aten.view.default, b.call(aten.t.default, p), [16])

    (reason,) = remove_resize_copy_resize(_chain_with(nested)).left_alone
    assert reason.kind is ResizeRefusalKind.VIEW_ESCAPES and "view_default" in reason.explanation


def test_other_mutation_of_the_input_leaves_the_chain_alone() -> None:
    gm = _chain_with(lambda b, p: (b.call(aten.add_.Tensor, p, 1), None)[1])
    (reason,) = remove_resize_copy_resize(gm).left_alone
    assert reason.kind is ResizeRefusalKind.OTHER_MUTATION and "add_" in reason.explanation


def test_read_between_resize_and_fill_leaves_the_chain_alone() -> None:
    b = GraphBuilder()
    p, src, x = b.inputs(("p", "src", "x"), _inputs())
    b.resize(p, 64)
    early = b.call(aten.mm.default, x, p)
    b.call(fsdp_copy(), p, src)
    b.resize(p, 0)
    (reason,) = remove_resize_copy_resize(b.build(early)).left_alone
    assert (
        reason.kind is ResizeRefusalKind.UNPAIRED_RESIZES
        and "before the fill" in reason.explanation
    )


def test_grown_input_keeps_its_resize_and_fill_as_an_input_mutation() -> None:
    inputs = _inputs()
    b = GraphBuilder()
    p, src, x = b.inputs(("p", "src", "x"), inputs)
    b.resize(p, 64)
    b.call(fsdp_copy(), p, src)
    gm = b.build(b.call(aten.mm.default, x, p))
    result = remove_resize_copy_resize(gm)
    assert not result.modified and not result.left_alone
    param = empty_param(4, 4)
    alias = param.view(16)  # user code keeps an alias of the unsharded parameter
    out = gm(param, inputs[1], inputs[2])
    torch.testing.assert_close(out[0], inputs[2] @ inputs[1])
    assert param.untyped_storage().nbytes() == 64
    torch.testing.assert_close(alias, inputs[1].reshape(16))
