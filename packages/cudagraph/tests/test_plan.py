"""The partition plan: classification, maximal segments, order constraints,
passthrough inputs, serialization and the plan verifier."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx
from _cg_helpers import CUDA, fake_inputs, needs_cuda_build, plan_of, trace_fake

from loom_cudagraph import (
    CudagraphOptions,
    CudagraphRefusalKind,
    PartitionPlan,
    PlanError,
    classify_node,
    mark_non_capturable,
    plan_graph,
    unmark_non_capturable,
)


def _kinds(plan: PartitionPlan) -> list[tuple[bool, set[CudagraphRefusalKind]]]:
    return [(s.captured, {r.kind for r in s.reasons}) for s in plan.segments]


def test_pure_device_graph_is_one_captured_segment() -> None:
    plan = plan_of(lambda x, w: (x @ w).relu() + 1, ((8, 4), CUDA), ((4, 4), CUDA), static=(1,))
    assert _kinds(plan) == [(True, set())]
    assert plan.skips() == ()
    assert plan.static_inputs == (1,)
    assert plan.device == "cuda:0"


def test_meta_tensor_beside_cuda_tensor_is_captured_without_skip() -> None:
    plan = plan_of(lambda t, y: (t * 2, y * 3), ((1, 16, 8, 8), "meta"), ((64,), CUDA))
    assert _kinds(plan) == [(True, set())]
    assert plan.skips() == ()


@needs_cuda_build
def test_cpu_copy_in_the_middle_leaves_captured_segments_around_it() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x1 = x + 1
        y1 = y + 1
        y_cpu = y1.cpu() + 1
        z = x @ y
        return x1 + y1 + z + y_cpu.cuda()

    plan = plan_of(f, ((2, 2), CUDA), ((2, 2), CUDA))
    assert [s.captured for s in plan.segments] == [True, False, True]
    middle = plan.segments[1]
    assert {r.kind for r in middle.reasons} == {
        CudagraphRefusalKind.DEVICE_COPY,
        CudagraphRefusalKind.CPU_TENSOR,
    }
    assert middle.cuda_work
    # x + 1, y + 1, x @ y and their sum do not depend on the host op: they all
    # join the first segment, and only the final add waits for the copy back.
    assert plan.segments[0].nodes == ("add", "add_1", "mm", "add_3", "add_4")
    assert len(plan.segments[2].nodes) == 1
    assert [r.kind for r in plan.skips()] == [
        CudagraphRefusalKind.DEVICE_COPY,
        CudagraphRefusalKind.DEVICE_COPY,
    ]


def test_host_only_node_is_refused_but_is_no_cuda_skip() -> None:
    plan = plan_of(lambda x, c: (x + 1, c * 2), ((4,), CUDA), ((4,), "cpu"))
    host = [s for s in plan.segments if not s.captured]
    assert len(host) == 1 and not host[0].cuda_work
    assert plan.skips() == ()


@needs_cuda_build
def test_item_and_nonzero_are_sync_and_data_dependent() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, object, torch.Tensor]:
        return x + 1, x.sum().item(), torch.nonzero(x)

    plan = plan_of(f, ((4,), CUDA))
    kinds = {r.kind for r in plan.skips()}
    assert kinds == {CudagraphRefusalKind.SYNC_OP, CudagraphRefusalKind.DATA_DEPENDENT_SHAPE}
    ops = {r.op for r in plan.skips()}
    assert ops == {"aten._local_scalar_dense.default", "aten.nonzero.default"}


def test_masked_select_has_a_data_dependent_shape() -> None:
    plan = plan_of(lambda x: torch.masked_select(x, x > 0) * 2, ((4,), CUDA))
    assert CudagraphRefusalKind.DATA_DEPENDENT_SHAPE in {r.kind for r in plan.skips()}
    # the multiply reads an unbacked size: it stays out of the graph too
    assert not plan.segments[-1].captured


@needs_cuda_build
def test_integer_tensor_indexing_is_captured_and_boolean_masks_are_not() -> None:
    # aten.index.Tensor carries dynamic_output_shape for its mask form only
    def gather(t: torch.Tensor) -> torch.Tensor:
        i = torch.arange(4, device=t.device)
        return t[i, i] * 2

    plan = plan_of(gather, ((8, 8), CUDA))
    assert plan.skips() == () and all(s.captured for s in plan.segments)
    masked = plan_of(lambda t: t[t > 0] * 2, ((8, 8), CUDA))
    assert {r.op for r in masked.skips()} >= {"aten.index.Tensor"}
    assert CudagraphRefusalKind.DATA_DEPENDENT_SHAPE in {r.kind for r in masked.skips()}


def test_user_marked_op_is_refused_until_unmarked() -> None:
    mark_non_capturable(torch.ops.aten.sin, "my kernel reads host memory", "call it outside")
    try:
        plan = plan_of(lambda x: (x + 1).sin() * 2, ((4,), CUDA))
        (reason,) = plan.skips()
        assert reason.kind is CudagraphRefusalKind.USER_MARKED
        assert reason.explanation == "my kernel reads host memory"
        assert [s.captured for s in plan.segments] == [True, False, True]
    finally:
        unmark_non_capturable(torch.ops.aten.sin)
    assert plan_of(lambda x: (x + 1).sin() * 2, ((4,), CUDA)).skips() == ()


def test_custom_op_tagged_cudagraph_unsafe_is_refused() -> None:
    @torch.library.custom_op(
        "loomtest::unsafe_double", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
    )
    def unsafe_double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @unsafe_double.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    plan = plan_of(lambda x: unsafe_double(x + 1) + 1, ((4,), CUDA))
    (reason,) = plan.skips()
    assert reason.kind is CudagraphRefusalKind.USER_MARKED
    assert "cudagraph_unsafe" in reason.explanation


def _graph_with_call(
    target: object, args_vals: list[torch.Tensor], out_val: object
) -> torch.fx.Node:
    g = torch.fx.Graph()
    phs = []
    for i, v in enumerate(args_vals):
        ph = g.placeholder(f"a{i}")
        ph.meta["val"] = v
        phs.append(ph)
    node = g.call_function(target, tuple(phs))  # type: ignore[arg-type]
    node.meta["val"] = out_val
    node.meta["stack_trace"] = '  File "/user/train.py", line 12, in step\n    y = op(x)\n'
    g.output(node)
    return node


def test_collective_is_refused_with_its_source_line() -> None:
    _, (x,) = fake_inputs(((4,), CUDA))
    node = _graph_with_call(torch.ops._c10d_functional.all_reduce.default, [x], x)
    reason = classify_node(node, torch.device("cuda", 0))
    assert reason is not None and reason.kind is CudagraphRefusalKind.COLLECTIVE
    assert reason.where == "/user/train.py:12 in step"


def test_rng_state_wrappers_and_second_device_are_refused() -> None:
    _, (x, other) = fake_inputs(((4,), "cuda:0"), ((4,), "cuda:1"))
    node = _graph_with_call(torch.ops.aten.add.Tensor, [x, other], x)
    reason = classify_node(node, torch.device("cuda", 0))
    assert reason is not None and reason.kind is CudagraphRefusalKind.OTHER_DEVICE
    from torch._prims.rng_prims import run_and_save_rng_state

    node = _graph_with_call(run_and_save_rng_state, [x], x)
    reason = classify_node(node, torch.device("cuda", 0))
    assert reason is not None and reason.kind is CudagraphRefusalKind.RNG_STATE


def test_device_without_an_index_means_the_graphs_own_cuda_device() -> None:
    # ``device="cuda"`` once compared unequal to the graph's ``cuda:0`` tensors
    # and refused every node as OTHER_DEVICE, so nothing was captured.
    for spec in ("cuda:0", "cuda:1"):
        gm, inputs = trace_fake(lambda t: t * 2 + 1, ((16,), spec))
        for device in ("cuda", torch.device("cuda")):
            plan = plan_graph(gm, inputs, (), CudagraphOptions(), device=device)
            assert _kinds(plan) == [(True, set())]
            assert plan.device == spec
    # An explicit index is kept: the other device's work is refused.
    gm, inputs = trace_fake(lambda t, u: (t * 2, u * 3), ((4,), "cuda:0"), ((4,), "cuda:1"))
    plan = plan_graph(gm, inputs, (), CudagraphOptions(), device="cuda:1")
    assert plan.device == "cuda:1"
    assert [s.nodes for s in plan.captured_segments] == [("mul_1",)]
    assert {r.kind for s in plan.segments for r in s.reasons} == {CudagraphRefusalKind.OTHER_DEVICE}


def test_getitem_follows_its_producer() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        vals = torch.ops.aten._unique2(x)[0]
        return vals * 2

    plan = plan_of(f, ((4,), CUDA))
    seg = next(s for s in plan.segments if any(n.startswith("_unique2") for n in s.nodes))
    assert any(n.startswith("getitem") for n in seg.nodes)


@needs_cuda_build
def test_small_segments_run_uncaptured_with_a_threshold() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).cpu().cuda() * 2

    plan = plan_of(f, ((4,), CUDA), min_segment_nodes=2)
    assert not any(s.captured for s in plan.segments)
    # the demoted segments merged with their uncaptured neighbour
    assert len(plan.segments) == 1
    assert CudagraphRefusalKind.TOO_SMALL in {r.kind for r in plan.skips()}


@needs_cuda_build
def test_mutation_keeps_its_order_after_earlier_readers() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        host = x.cpu()
        x.copy_(x * 2)
        return host

    gm, inputs = trace_fake(f, ((4,), CUDA))
    plan = plan_graph(gm, inputs)
    seg_of = {n: s.index for s in plan.segments for n in s.nodes}
    copy_node = next(n for n in seg_of if n.startswith("copy_"))
    to_cpu = next(n for n in seg_of if n.startswith("_to_copy"))
    assert seg_of[copy_node] > seg_of[to_cpu]
    assert plan.segments[seg_of[copy_node]].mutated_inputs == ("x_1",)


@needs_cuda_build
def test_random_draws_keep_their_order() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.rand(4, device=x.device)
        host = x.cpu().sum()
        b = torch.rand(4, device=x.device) + host.cuda()
        c = torch.rand(4, device=x.device)
        return a + c, b

    gm, inputs = trace_fake(f, ((4,), CUDA))
    plan = plan_graph(gm, inputs)
    seg_of = {n: s.index for s in plan.segments for n in s.nodes}
    rands = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.rand.default]
    assert [seg_of[r] for r in rands] == sorted(seg_of[r] for r in rands)
    flat = [n for s in plan.segments for n in s.nodes if n in rands]
    assert flat == rands


@needs_cuda_build
def test_input_read_again_after_a_host_op_passes_through_the_first_segment() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = (x + 1).cpu()
        return x * a.cuda()

    plan = plan_of(f, ((4,), CUDA))
    first, _, last = plan.segments
    assert first.passthrough == ("x_1",) and "x_1" in first.outputs
    assert "x_1" in last.inputs


@needs_cuda_build
def test_static_inputs_are_never_passed_through() -> None:
    def f(w: torch.Tensor) -> torch.Tensor:
        a = (w + 1).cpu()
        return w * a.cuda()

    plan = plan_of(f, ((4,), CUDA), static=(0,))
    assert all(s.passthrough == () for s in plan.segments)


def test_segment_inputs_keep_placeholder_order() -> None:
    # a backward takes saved tensors first, then tangents
    def bw(saved_a: torch.Tensor, saved_b: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
        return tangent * saved_b + saved_a

    plan = plan_of(bw, ((4,), CUDA), ((4,), CUDA), ((4,), CUDA))
    assert plan.segments[0].inputs == ("saved_a_1", "saved_b_1", "tangent_1")


@needs_cuda_build
def test_plan_round_trips_through_json_and_is_deterministic() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).cpu().cuda() * torch.nonzero(x).sum()

    plan = plan_of(f, ((4,), CUDA), max_recording=3)
    again = PartitionPlan.from_json(plan.to_json())
    assert again == plan
    assert plan_of(f, ((4,), CUDA), max_recording=3).to_json() == plan.to_json()
    assert "fx" not in plan.to_json().lower().replace("fx_", "")


def test_no_cuda_graph_is_planned_uncaptured_without_skips() -> None:
    plan = plan_of(lambda x: x + 1, ((4,), "cpu"))
    assert plan.device is None
    assert [s.captured for s in plan.segments] == [False]
    assert plan.skips() == ()


def _valid_plan() -> PartitionPlan:
    return plan_of(lambda x: (x + 1).cpu().cuda() * 2, ((4,), CUDA))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: dataclasses.replace(p, segments=p.segments[1:]), "index 1 at position 0"),
        (
            lambda p: dataclasses.replace(
                p,
                segments=(
                    dataclasses.replace(p.segments[0], reasons=p.segments[1].reasons),
                    *p.segments[1:],
                ),
            ),
            "captured with 2 reasons",
        ),
        (
            lambda p: dataclasses.replace(
                p,
                segments=(
                    p.segments[0],
                    p.segments[1],
                    dataclasses.replace(p.segments[2], nodes=p.segments[0].nodes),
                ),
            ),
            "is in two segments",
        ),
        (
            lambda p: dataclasses.replace(
                p, segments=(dataclasses.replace(p.segments[0], inputs=("ghost",)), *p.segments[1:])
            ),
            "input ghost is not produced before it",
        ),
        (lambda p: dataclasses.replace(p, static_inputs=(3,)), "static input index out of range"),
    ],
)
@needs_cuda_build
def test_check_reports_a_corrupted_plan(corrupt: object, message: str) -> None:
    plan = _valid_plan()
    plan.check()
    bad = corrupt(plan)  # type: ignore[operator]
    with pytest.raises(PlanError, match=message):
        bad.check()


def test_options_validate_and_read_the_or_error_environment_variable() -> None:
    with pytest.raises(ValueError, match="max_recording"):
        CudagraphOptions(max_recording=-1)
    opts = CudagraphOptions().with_env({"TORCHLOOM_CUDAGRAPH_OR_ERROR": "1"})
    assert opts.or_error
    assert not CudagraphOptions().with_env({}).or_error


def test_getitem_helper_is_not_a_work_node() -> None:
    plan = plan_of(lambda x: torch.split(x, 2)[0] * 2, ((4,), CUDA))
    (seg,) = plan.segments
    names = seg.nodes
    assert any(n.startswith("getitem") for n in names)
    assert seg.work_nodes == len(names) - sum(n.startswith("getitem") for n in names)


def test_cpu_scalar_constant_is_captured_but_cpu_scalar_input_is_not() -> None:
    _, (x, s) = fake_inputs(((4,), CUDA), ((), "cpu"))
    g = torch.fx.Graph()
    px, ps = g.placeholder("x"), g.placeholder("s")
    px.meta["val"], ps.meta["val"] = x, s
    const = g.get_attr("_tensor_constant0")
    const.meta["val"] = s
    mul_const = g.call_function(torch.ops.aten.mul.Tensor, (px, const))
    mul_const.meta["val"] = x
    mul_input = g.call_function(torch.ops.aten.mul.Tensor, (px, ps))
    mul_input.meta["val"] = x
    cuda = torch.device("cuda", 0)
    assert classify_node(mul_const, cuda) is None
    reason = classify_node(mul_input, cuda)
    assert reason is not None and reason.kind is CudagraphRefusalKind.CPU_TENSOR


@pytest.mark.parametrize(("dropout", "captured"), [(0.0, True), (0.1, False)])
def test_attention_backward_with_cpu_seed_is_captured_only_without_dropout(
    dropout: float, captured: bool
) -> None:
    """Memory-efficient attention hands its dropout seed and offset to the backward
    as CPU scalars (FSDP2's compiled-autograd backward reads them as inputs). With
    ``dropout_p == 0`` the kernel never reads them, so the op is captured; with
    dropout on, the seed would be frozen into the graph, so it is not."""
    q = ((1, 2, 8, 16), CUDA)
    _, (grad, query, key, value, out) = fake_inputs(q, q, q, q, q)
    _, (lse,) = fake_inputs(((1, 2, 32), CUDA))
    _, (seed, offset) = fake_inputs(((), "cpu"), ((), "cpu"))
    g = torch.fx.Graph()
    nodes = []
    for name, val in [
        ("grad", grad), ("q", query), ("k", key), ("v", value), ("out", out),
        ("lse", lse), ("seed", seed), ("offset", offset),
    ]:  # fmt: skip
        n = g.placeholder(name)
        n.meta["val"] = val
        nodes.append(n)
    gr, qn, kn, vn, on, ln, sn, offn = nodes
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    bw = g.call_function(
        op, (gr, qn, kn, vn, None, on, ln, sn, offn, dropout, [True, True, True, False])
    )
    bw.meta["val"] = (query, key, value, None)
    reason = classify_node(bw, torch.device("cuda", 0))
    if captured:
        assert reason is None
    else:
        assert reason is not None and reason.kind is CudagraphRefusalKind.CPU_TENSOR


def test_collectives_stay_in_program_order_between_the_layers_they_feed() -> None:
    """A collective moves above no node before it: an FSDP2-like graph (gather a
    layer's weight, then compute with it) keeps one layer's weight gathered at a
    time, not every gather first and every layer's compute after."""
    from loom_cudagraph import mark_non_capturable, unmark_non_capturable

    mark_non_capturable(
        torch.ops.aten.cos, "stands in for an all-gather", kind=CudagraphRefusalKind.COLLECTIVE
    )
    try:

        def f(
            x: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor
        ) -> torch.Tensor:
            for shard in (s0, s1, s2):
                w = shard.cos()  # the "all-gather": depends on a graph input alone
                x = torch.tanh(x @ w)
            return x

        plan = plan_of(f, ((4, 4), CUDA), ((4, 4), CUDA), ((4, 4), CUDA), ((4, 4), CUDA))
    finally:
        unmark_non_capturable(torch.ops.aten.cos)
    seg_of = {n: s.index for s in plan.segments for n in s.nodes}
    gathers = sorted((n for n in seg_of if n.startswith("cos")), key=seg_of.__getitem__)
    matmuls = sorted((n for n in seg_of if n.startswith("mm")), key=seg_of.__getitem__)
    assert len(gathers) == len(matmuls) == 3
    order = [seg_of[n] for pair in zip(gathers, matmuls, strict=True) for n in pair]
    # gather 0 < layer 0 < gather 1 < layer 1 < gather 2 < layer 2
    assert order == sorted(order) and len(set(order)) == 6, plan.segments
    assert all(not plan.segments[seg_of[g]].captured for g in gathers)
    assert all(plan.segments[seg_of[m]].captured for m in matmuls)
