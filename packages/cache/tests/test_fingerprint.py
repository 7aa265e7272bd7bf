"""Graph fingerprints: canonical, complete, and refusing what they cannot see."""

from __future__ import annotations

import operator

import torch
import torch.fx

from loom_cache import USER_CACHE_HASH, CacheBypassKind, graph_fingerprint


def _traced(fn, *example: torch.Tensor) -> torch.fx.GraphModule:  # type: ignore[no-untyped-def]
    """An FX graph with tensor metadata on every node, as Dynamo hands it over."""
    from torch.fx.passes.shape_prop import ShapeProp

    gm = torch.fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(*example)
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None:
            node.meta["val"] = torch.empty_strided(
                meta.shape,
                meta.stride,
                dtype=meta.dtype,
                device="meta",
                requires_grad=meta.requires_grad,
            )
    return gm


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2.0).sum(0)


def test_node_names_do_not_matter() -> None:
    gm = _traced(_f, torch.randn(3, 4))
    before = graph_fingerprint(gm).digest
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "output":
            node.name = f"renamed_{i}"
    gm.recompile()
    assert graph_fingerprint(gm).digest == before


def test_metadata_and_constants_change_the_digest() -> None:
    base = graph_fingerprint(_traced(_f, torch.randn(3, 4))).digest
    shapes = graph_fingerprint(_traced(_f, torch.randn(3, 5))).digest
    dtypes = graph_fingerprint(_traced(_f, torch.randn(3, 4, dtype=torch.float64))).digest
    strides = graph_fingerprint(_traced(_f, torch.randn(4, 3).t())).digest
    grads = graph_fingerprint(_traced(_f, torch.randn(3, 4, requires_grad=True))).digest
    constant = graph_fingerprint(
        _traced(lambda x: torch.relu(x * 3.0).sum(0), torch.randn(3, 4))
    ).digest
    assert len({base, shapes, dtypes, strides, grads, constant}) == 6


def test_argument_order_and_targets_change_the_digest() -> None:
    sub = graph_fingerprint(_traced(lambda x, y: x - y, torch.ones(2), torch.ones(2))).digest
    bus = graph_fingerprint(_traced(lambda x, y: y - x, torch.ones(2), torch.ones(2))).digest
    add = graph_fingerprint(_traced(lambda x, y: x + y, torch.ones(2), torch.ones(2))).digest
    assert len({sub, bus, add}) == 3


@torch.fx.wrap
def _opaque_scale(t: torch.Tensor) -> torch.Tensor:
    return t * 4


def _hook_like(x: torch.Tensor) -> torch.Tensor:
    return _opaque_scale(x) + 1


def test_opaque_call_without_user_cache_hash_bypasses_the_cache() -> None:
    fp = graph_fingerprint(_traced(_hook_like, torch.randn(3)))
    assert fp.bypass is not None
    assert fp.bypass.kind is CacheBypassKind.OPAQUE_CALL
    assert "_opaque_scale" in fp.bypass.explanation
    assert USER_CACHE_HASH in fp.bypass.hint


def test_user_cache_hash_makes_an_opaque_call_cacheable_and_enters_the_key() -> None:
    digests = []
    for version in ("v1", "v1", "v2"):
        gm = _traced(_hook_like, torch.randn(3))
        for node in gm.graph.nodes:
            if node.target is _opaque_scale:
                node.meta[USER_CACHE_HASH] = version
        fp = graph_fingerprint(gm)
        assert fp.cacheable
        digests.append(fp.digest)
    assert digests[0] == digests[1] != digests[2]
    code = next(c for c in graph_fingerprint(gm).components if c.name == "code")
    assert "user_cache_hash=v2" in code.detail


def test_builtin_and_operator_targets_are_transparent() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(operator.getitem, (x, 0))
    g.output(g.call_function(len, (y,)))
    assert graph_fingerprint(torch.fx.GraphModule({}, g)).cacheable


def _with_subgraph(scale: float) -> torch.fx.GraphModule:
    inner = torch.fx.symbolic_trace(lambda t: t * scale)
    root = torch.nn.Module()
    root.body = inner  # type: ignore[assignment]
    g = torch.fx.Graph()
    x = g.placeholder("x")
    body = g.get_attr("body")
    g.output(g.call_function(torch.ops.higher_order.invoke_subgraph, (body, "sub", x)))
    return torch.fx.GraphModule(root, g)


def test_subgraphs_contribute_their_own_fingerprint() -> None:
    assert (
        graph_fingerprint(_with_subgraph(2.0)).digest
        == graph_fingerprint(_with_subgraph(2.0)).digest
    )
    assert (
        graph_fingerprint(_with_subgraph(2.0)).digest
        != graph_fingerprint(_with_subgraph(3.0)).digest
    )


_CUSTOM_NS: dict[str, object] = {"torch": torch, "K": 2}
exec(
    "from torch import Tensor\n"
    "@torch.library.custom_op('loomcachetest::scale', mutates_args=())\n"
    "def op(x: Tensor) -> Tensor:\n    return x * K\n"
    "@op.register_fake\n"
    "def _(x):\n    return torch.empty_like(x)\n",
    _CUSTOM_NS,
)


def _custom_op_code_digest() -> str:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.loomcachetest.scale.default, (x,)))
    fp = graph_fingerprint(torch.fx.GraphModule({}, g))
    assert fp.cacheable
    return next(c.digest for c in fp.components if c.name == "code")


def test_custom_op_python_implementation_enters_the_key() -> None:
    # Same op, same schema, same graph: only the implementation's behaviour changes.
    before = _custom_op_code_digest()
    assert _custom_op_code_digest() == before
    _CUSTOM_NS["K"] = 3
    try:
        assert _custom_op_code_digest() != before
    finally:
        _CUSTOM_NS["K"] = 2


def test_static_input_marking_enters_the_inputs_component() -> None:
    plain = _traced(_f, torch.randn(3, 4))
    marked = _traced(_f, torch.randn(3, 4))
    next(iter(marked.graph.nodes)).meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    a, b = graph_fingerprint(plain), graph_fingerprint(marked)
    changed = [x.name for x, y in zip(a.components, b.components, strict=True) if x != y]
    assert changed == ["inputs"]
