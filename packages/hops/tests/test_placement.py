"""place_saved_tensor_hooks: pack after last forward use, unpack before first backward use."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import hook_modules as hm
import pytest
import torch
import torch.fx
from _hooks_backend import hooks_backend

import loom_hops
from loom_hops import PackScope, Placement, pack_hook_op, unpack_hook_op


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU()
    )


def _run(model: torch.nn.Module, x: torch.Tensor, hooks: Any, compiled: bool, **kw: Any) -> Any:
    model.zero_grad()
    x = x.detach().requires_grad_(True)
    fn: Any = model
    log = None
    if compiled:
        backend, log = hooks_backend(**kw)
        fn = torch.compile(model, backend=backend, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        out = fn(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
    return out.detach(), grads, log


def _placement(log: Any) -> Placement:
    (placement,) = log.placements
    assert isinstance(placement, Placement), placement
    return placement


@pytest.mark.parametrize("hooks", [hm.bf16, hm.fp8, hm.offload, hm.deciding])
def test_compiled_hooks_match_eager_hooks(hooks: Any) -> None:
    model, x = _mlp(), torch.randn(8, 16)
    out_e, grads_e, _ = _run(model, x, hooks(), compiled=False)
    out_c, grads_c, log = _run(model, x, hooks(), compiled=True)
    placement = _placement(log)
    assert placement.packed
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)


def test_pack_sits_right_after_the_last_forward_use() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, inline=False)
    placement = _placement(log)
    fw = placement.forward.graph
    nodes = list(fw.nodes)
    for packed in placement.packed:
        saved = next(n for n in nodes if n.name == packed.name)
        hop = next(u for u in saved.users if u.target is pack_hook_op)
        others = [u for u in saved.users if u is not hop and u.op != "output"]
        last = max(others, key=nodes.index) if others else saved
        assert last.name == packed.pack_after or saved.op == "placeholder"
        between = nodes[nodes.index(last) + 1 : nodes.index(hop)]
        assert all(
            n.op in ("get_attr", "placeholder") or n.target in (pack_hook_op, operator.getitem)
            for n in between
        ), [n.name for n in between]


def test_unpack_sits_right_before_the_first_backward_use() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, inline=False)
    placement = _placement(log)
    nodes = list(placement.backward.graph.nodes)
    hops = [n for n in nodes if n.target is unpack_hook_op]
    assert len(hops) == len(placement.packed)
    for hop in hops:
        (out,) = hop.users
        first = min(out.users, key=nodes.index)
        assert nodes.index(first) == nodes.index(out) + 1 or all(
            n.target in (unpack_hook_op, operator.getitem) or n.op == "get_attr"
            for n in nodes[nodes.index(out) + 1 : nodes.index(first)]
        )


def test_what_crosses_is_the_packed_value_and_constants_are_folded() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, inline=False)
    placement = _placement(log)
    saved = list(placement.forward.graph.output_node().args[0])[placement.num_fwd_outputs :]
    assert saved and all(n.meta["val"].dtype == torch.bfloat16 for n in saved)
    assert all(len(p.crossing) == 1 for p in placement.packed)  # the dtype stayed behind


def test_default_scope_packs_parameters_like_eager() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True)
    origins = {p.origin for p in _placement(log).packed}
    assert loom_hops.SavedOrigin.INPUT in origins and loom_hops.SavedOrigin.ACTIVATION in origins


def test_activation_scope_keeps_inputs_and_parameters_as_they_are() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, scope=PackScope.ACTIVATIONS)
    placement = _placement(log)
    assert placement.packed and {p.origin for p in placement.packed} == {
        loom_hops.SavedOrigin.ACTIVATION
    }
    assert placement.kept and all("input" in why for _, why in placement.kept)


def test_per_tensor_decision_is_made_for_each_saved_tensor() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(2, 4)
    _, grads_e, _ = _run(model, x, hm.deciding(), compiled=False)
    _, grads_c, log = _run(model, x, hm.deciding(), compiled=True)
    placement = _placement(log)
    saved = list(placement.forward.graph.output_node().args[0])[placement.num_fwd_outputs :]
    dtypes = {n.meta["val"].dtype for n in saved}
    assert dtypes == {torch.float32, torch.bfloat16}  # small ones kept, big ones cast
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)


def test_eager_hooks_are_not_applied_again_to_what_the_graph_saves() -> None:
    calls = {"pack": 0}
    pack, unpack = hm.bf16()

    class Counting(torch.fx.GraphModule):
        def __call__(self, *a: Any, **k: Any) -> Any:
            calls["pack"] += 1
            return super().__call__(*a, **k)

    counting = Counting(pack, pack.graph)
    model, x = _mlp(), torch.randn(8, 16, requires_grad=True)
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(counting, unpack):
        fn(x).sum().backward()  # compiles: the pack graph is traced (calls at compile time)
        calls["pack"] = 0
        fn(x).sum().backward()
    assert log.compiles == 1 and calls["pack"] == 0


def test_a_mismatching_unpack_is_refused_and_nothing_changes() -> None:
    class BadUnpack(torch.nn.Module):
        def forward(self, p: Any) -> torch.Tensor:
            return p[1]  # stays bf16

    hooks = hm.pair(hm.Bf16Pack(), BadUnpack())
    backend, log = hooks_backend()
    fn = torch.compile(_mlp(), backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        fn(torch.randn(8, 16, requires_grad=True))  # backward would fail, as in eager
    (refusal,) = log.placements
    assert isinstance(refusal, loom_hops.Unsupported)
    assert refusal.kind is loom_hops.HopsRefusalKind.UNPACK_MISMATCH
    assert "bfloat16" in refusal.explanation


def test_check_catches_misaligned_saved_values() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, inline=False)
    placement = _placement(log)
    first = next(n for n in placement.backward.graph.nodes if n.op == "placeholder")
    placement.check()
    first.name = "renamed_input"  # a renamed input with the same metadata still lines up
    placement.check()
    first.meta["val"] = torch.empty((), dtype=torch.int64)
    with pytest.raises(AssertionError, match="forward saves"):
        placement.check()


@pytest.mark.parametrize("make_hooks", [hm.fp8, hm.flat])
def test_dynamic_shapes_compile_once_and_serve_every_size(make_hooks: Any) -> None:
    model = _mlp()
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    hooks = make_hooks()
    for batch in (3, 5, 9):
        x = torch.randn(batch, 16)
        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out_c = fn(x)
        out_c.sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out_e = model(x)
        out_e.sum().backward()
        torch.testing.assert_close(out_c, out_e)
        for a, b in zip(got, [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(a, b)
    assert log.compiles == 1
    placement = _placement(log)
    assert any(not dim.isdigit() for p in placement.packed for dim in p.shape)


def test_sizes_a_pack_returns_cross_as_symbolic_outputs_when_dynamic() -> None:
    model = _mlp()
    backend, log = hooks_backend(inline=False)
    fn = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(*hm.flat()):
        fn(torch.randn(5, 16, requires_grad=True)).sum().backward()
    placement = _placement(log)
    placement.check()
    crossing = {name for p in placement.packed for name in p.crossing}
    sym_inputs = [
        n
        for n in placement.backward.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)
    ]
    assert any(n.name in crossing for n in sym_inputs)


@pytest.mark.parametrize("hooks", [hm.bf16, hm.offload])
def test_an_unpacked_tensor_lives_only_around_the_op_that_uses_it(hooks: Any) -> None:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(4):
        blocks += [torch.nn.Linear(16, 16), torch.nn.GELU()]
    _, _, log = _run(torch.nn.Sequential(*blocks), torch.randn(8, 16), hooks(), True, inline=False)
    nodes = list(_placement(log).backward.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    unpacked = [next(iter(n.users)) for n in nodes if n.target is unpack_hook_op]
    assert len(unpacked) == len(_placement(log).packed)
    live_at_once = 0
    for out in unpacked:
        first, last = min(at[u] for u in out.users), max(at[u] for u in out.users)
        # every other unpack while this one is live feeds the same op (its other operand)
        for other in unpacked:
            if other is not out and at[out] < at[other] < last:
                assert set(other.users) & set(out.users), (out.name, other.name)
        live_at_once = max(
            live_at_once, sum(at[o] <= first <= max(map(at.get, o.users)) for o in unpacked)
        )
    assert live_at_once <= 2  # at most both operands of one op, never a layer's worth


def test_the_placement_says_which_packed_values_moved_device() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    _, _, log = _run(model, x, hm.offload(), compiled=True, inline=False)
    placement = _placement(log)
    assert all(p.crossing_devices == ("cpu",) for p in placement.packed)
    assert placement.moved == ()  # offloading to the CPU from the CPU moves nothing
    moved = dataclasses.replace(placement.packed[0], device="cuda:0")
    assert moved.moves_device and not placement.packed[0].moves_device
    assert dataclasses.replace(placement, packed=(moved,)).moved == (moved.name,)


# -- activation checkpointing -------------------------------------------------------


class _CheckpointedAttention(torch.nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around SDPA, as HF models use it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(32, 32)

    def attention(self, t: torch.Tensor) -> torch.Tensor:
        q = self.q(t).view(2, 8, 2, 16).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.utils.checkpoint.checkpoint(self.attention, h, use_reentrant=False)
        return out  # type: ignore[no-any-return]


def test_checkpointed_sdpa_packs_the_region_input_as_eager_does() -> None:
    # NOTE: the partitioner saves CPU SDPA's RNG state (it is nondeterministic_seeded)
    # and the backward takes it under another name: saved values match by position.
    model, x = _CheckpointedAttention(), torch.randn(2, 8, 32)
    out_e, grads_e, _ = _run(model, x, hm.bf16(), compiled=False)
    out_c, grads_c, log = _run(model, x, hm.bf16(), compiled=True)
    placement = _placement(log)
    assert [p.name for p in placement.packed] == ["primals_1"]  # the region's argument
    reasons = dict(placement.kept)
    assert (
        reasons["primals_2"]
        == reasons["primals_3"]
        == ("parameter read only inside checkpointed regions")
    )
    # torch 2.11 saves CPU SDPA's RNG state for the recomputation (kept unpacked, as
    # eager never packs it); newer releases save none: either way nothing else is kept
    rng = "RNG state of an op recomputed in backward"
    assert set(reasons.values()) <= {rng, "parameter read only inside checkpointed regions"}
    rng_saved = any(
        n.name.startswith("rng_state_output")
        for n in placement.backward.graph.nodes
        if n.op == "placeholder"
    )
    assert (rng in reasons.values()) == rng_saved
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)


def test_saved_values_match_backward_inputs_by_position_not_name() -> None:
    model, x = _CheckpointedAttention(), torch.randn(2, 8, 32)
    _, _, log = _run(model, x, hm.bf16(), compiled=True, inline=False)
    placement = _placement(log)
    saved = list(placement.forward.graph.output_node().args[0])[placement.num_fwd_outputs :]
    ins = [n for n in placement.backward.graph.nodes if n.op == "placeholder"]
    renamed = [(f.name, b.name) for f, b in zip(saved, ins, strict=False) if f.name != b.name]
    # the only inputs renamed are RNG states (torch 2.11 saves one for CPU SDPA; newer
    # releases none): the positional match must count the same outputs either way
    assert all(b.startswith("rng_state_output") for _, b in renamed)
    assert loom_hops.count_forward_outputs(placement.forward, placement.backward) == (
        placement.num_fwd_outputs
    )


# -- strides of what unpack returns ---------------------------------------------------


class _Transposed(torch.nn.Module):
    """Saves transposed (non-contiguous) tensors, as attention's reshapes make."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        return torch.matmul(a, v).transpose(1, 2).reshape(2, 8, 16)


def _dense_copy_pack(t: torch.Tensor) -> Any:
    packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)  # contiguous
    packed.copy_(t)
    return (t.device, packed)


def _to_device_unpack(p: Any) -> torch.Tensor:
    device, t = p
    return t.to(device)  # type: ignore[no-any-return]


class _StrideCheck(torch.fx.Interpreter):
    """Runs a graph and records every node whose tensor's strides differ from its meta."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.wrong: list[str] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        want = n.meta.get("val")
        if isinstance(out, torch.Tensor) and isinstance(want, torch.Tensor):
            pairs = zip(want.shape, want.stride(), out.stride(), strict=True)
            if any(size > 1 and a != b for size, a, b in pairs):
                self.wrong.append(f"{n.name}: meta {want.stride()} ran {out.stride()}")
        return out


def test_an_unpack_that_returns_other_strides_is_copied_to_the_saved_strides() -> None:
    """save_on_cpu packs into a contiguous buffer: the unpacked tensor of a transposed
    saved tensor is contiguous, while the backward was traced with its strides."""
    torch.manual_seed(0)
    model, x = _Transposed(), torch.randn(2, 8, 16)
    hooks = (_dense_copy_pack, _to_device_unpack)
    out_e, grads_e, _ = _run(model, x, hooks, compiled=False)
    out_c, grads_c, log = _run(model, x, hooks, compiled=True, inline=False)
    placement = _placement(log)
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)
    backward = placement.backward
    restrides = [
        n for n in backward.graph.nodes if n.target is torch.ops.prims.copy_strided.default
    ]
    transposed = [
        p.name
        for p in placement.packed
        if not next(n for n in placement.forward.graph.nodes if n.name == p.name)
        .meta["val"]
        .is_contiguous()
    ]
    assert transposed and len(restrides) == len(transposed)
    loom_hops.inline_subgraph_hops(backward)
    inputs = [
        torch.randn(v.shape).as_strided(v.shape, v.stride()) if isinstance(v, torch.Tensor) else v
        for v in (n.meta["val"] for n in backward.graph.nodes if n.op == "placeholder")
    ]
    check = _StrideCheck(backward)
    check.run(*inputs)
    assert check.wrong == []


# -- saved views of activations ---------------------------------------------------------


class _Conv1D(torch.nn.Module):
    """GPT-2's linear layer: ``addmm(bias, x.view(-1, nx), weight)`` with weight (nx, nf),
    whose weight gradient needs ``x.view(-1, nx).t()``."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


def _gpt2_mlps() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [_Conv1D(16, 64), torch.nn.GELU(), _Conv1D(64, 16)]
    return torch.nn.Sequential(*layers)


def test_a_saved_view_is_packed_where_its_base_is_last_used_not_at_the_forwards_end() -> None:
    """The min-cut partitioner makes the views it saves (``t`` of an activation, for a
    weight gradient) at the end of the forward: packed after that view, each full-size
    activation it views lived through every later layer (GPT-2 peaked above eager)."""
    model, x = _gpt2_mlps(), torch.randn(2, 8, 16)
    out_e, grads_e, _ = _run(model, x, hm.bf16(), compiled=False)
    out_c, grads_c, log = _run(model, x, hm.bf16(), compiled=True, inline=False, min_cut=True)
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge)
    placement = _placement(log)
    nodes = list(placement.forward.graph.nodes)
    by_name = {n.name: n for n in nodes}
    views = 0
    for packed in placement.packed:
        saved = by_name[packed.name]
        if not (saved.op == "call_function" and loom_hops._torch_compat.is_view_op(saved.target)):
            continue
        base = saved
        while base.op == "call_function" and loom_hops._torch_compat.is_view_op(base.target):
            base = base.args[0]
        if base.op == "placeholder":
            continue
        views += 1
        hop = next(u for u in saved.users if u.target is pack_hook_op)
        readers = [
            n
            for n in nodes[nodes.index(base) + 1 : nodes.index(hop)]
            if base in _aliases_read(n, base)
        ]
        after_last_read = nodes[nodes.index(readers[-1]) + 1 : nodes.index(hop)]
        # only views (the saved one), the pack machinery and other packs in between
        assert all(
            n.op == "get_attr"
            or n.target in (pack_hook_op, operator.getitem)
            or loom_hops._torch_compat.is_view_op(n.target)
            for n in after_last_read
        ), (packed.name, [n.name for n in after_last_read])
    assert views >= 3  # the ``t`` of each hidden activation


def _aliases_read(node: torch.fx.Node, base: torch.fx.Node) -> set[torch.fx.Node]:
    """The bases whose storage ``node`` reads (through views), if it is not a view."""
    if node.op != "call_function" or loom_hops._torch_compat.is_view_op(node.target):
        return set()
    found: set[torch.fx.Node] = set()
    for arg in node.all_input_nodes:
        while arg.op == "call_function" and loom_hops._torch_compat.is_view_op(arg.target):
            arg = arg.args[0]  # type: ignore[assignment]
        found.add(arg)
    return found


def test_attention_seed_and_offset_are_told_from_the_attention_outputs() -> None:
    # Their run-time device (a CPU scalar) is not their fake one: the placement keeps them.
    from loom_hops._torch_compat import is_sdpa_philox_output

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    aten = torch.ops.aten
    eff = graph.call_function(aten._scaled_dot_product_efficient_attention.default, (q, k, v))
    flash = graph.call_function(aten._scaled_dot_product_flash_attention.default, (q, k, v))
    picked = {
        (name, i): graph.call_function(operator.getitem, (op, i))
        for name, op, n in (("eff", eff, 4), ("flash", flash, 9))
        for i in range(n)
    }
    seeds = {key for key, node in picked.items() if is_sdpa_philox_output(node)}
    assert seeds == {("eff", 2), ("eff", 3), ("flash", 6), ("flash", 7)}
    assert not is_sdpa_philox_output(q) and not is_sdpa_philox_output(eff)
