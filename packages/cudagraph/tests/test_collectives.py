"""Collectives inside CUDA graphs (``_collectives``): which are captured, which stay
outside and why, and the plan and host runtime of a gathered-weights graph.

A 1-rank gloo group stands in for the job's group. Gloo cannot be captured (the
real check refuses it, naming the backend); tests of the captured path admit gloo
as a capturable backend (``CAPTURABLE_BACKENDS``), which is what NCCL passes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from _cg_helpers import CUDA, fake_inputs, trace_fake, trace_real

import loom_cudagraph._collectives as collectives_mod
from loom_cudagraph import (
    CudagraphOptions,
    CudagraphRefusalKind,
    CudagraphRuntime,
    HostCapturer,
    MemoryPool,
    PartitionPlan,
    build_runtime,
    classify_node,
    mark_non_capturable,
    plan_graph,
    unmark_non_capturable,
)
from loom_cudagraph._segment import CapturedSegment

funcol = torch.ops._c10d_functional
CPU = torch.device("cpu")
LAYERS, WIDTH, BATCH = 4, 16, 4
#: the explanation every collective had before collectives were captured (option off)
UNCAPTURED = "collectives run outside CUDA graphs in loom"


@pytest.fixture(scope="module")
def group() -> Iterator[str]:
    """The group name of a 1-rank gloo world made in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture
def capturable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo passes the backend check, as NCCL does."""
    monkeypatch.setattr(collectives_mod, "CAPTURABLE_BACKENDS", frozenset({"nccl", "gloo"}))


def gathered(group: str) -> Any:
    """A forward of ``LAYERS`` layers, each gathering its weight from a shard (FSDP2's
    all-gather and wait), then an all-reduce of the result."""

    def forward(x: torch.Tensor, *shards: torch.Tensor) -> torch.Tensor:
        for s in shards:
            w = funcol.wait_tensor(funcol.all_gather_into_tensor(s, 1, group))
            x = torch.tanh(x @ w.T)
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    return forward


def _plan(group: str, **options: Any) -> PartitionPlan:
    specs = [((BATCH, WIDTH), CUDA)] + [((WIDTH, WIDTH), CUDA)] * LAYERS
    gm, inputs = trace_fake(gathered(group), *specs)
    return plan_graph(
        gm, inputs, tuple(range(1, LAYERS + 1)), CudagraphOptions(**options), name="test"
    )


def _collective_reasons(plan: PartitionPlan) -> list[str]:
    return [
        r.explanation
        for s in plan.segments
        for r in s.reasons
        if r.kind is CudagraphRefusalKind.COLLECTIVE
    ]


def test_nccl_collectives_and_their_waits_join_one_captured_segment(
    group: str, capturable: None
) -> None:
    plan = _plan(group)
    assert [(s.captured, s.reasons) for s in plan.segments] == [(True, ())]
    names = plan.segments[0].nodes
    assert sum(n.startswith("all_gather_into_tensor") for n in names) == LAYERS
    assert sum(n.startswith("wait_tensor") for n in names) == LAYERS + 1
    assert plan.skips() == ()


def test_a_gloo_group_keeps_each_collective_outside_naming_the_backend(group: str) -> None:
    plan = _plan(group)
    reasons = _collective_reasons(plan)
    assert len(reasons) == 2 * (LAYERS + 1)  # every launch and every wait
    launches = [r for r in reasons if not r.startswith("waits on")]
    assert launches and all(
        f"process group {group!r} uses the gloo backend for cuda tensors" in r
        and "only NCCL collectives can be captured" in r
        for r in launches
    ), launches
    waits = [r for r in reasons if r.startswith("waits on")]
    assert len(waits) == LAYERS + 1 and all(
        "runs uncaptured: its process group" in r for r in waits
    )
    # each layer's compute is still captured, between the gathers in program order
    captured = [s for s in plan.segments if s.captured]
    assert len(captured) == LAYERS
    assert all(any(n.startswith("mm") for n in s.nodes) for s in captured)


def test_option_off_plans_as_before_collectives_were_captured(group: str, capturable: None) -> None:
    off = _plan(group, capture_collectives=False)
    assert set(_collective_reasons(off)) == {UNCAPTURED}
    assert len(_collective_reasons(off)) == 2 * (LAYERS + 1)
    # gather | layer | gather | layer ... | all-reduce: uncaptured collectives split it
    assert [s.captured for s in off.segments] == [False, True] * LAYERS + [False]
    assert off.options.capture_collectives is False


def test_unknown_group_name_is_refused_as_unresolved(group: str) -> None:
    plan = _plan("no-such-group")
    launches = [r for r in _collective_reasons(plan) if not r.startswith("waits on")]
    assert launches and all(
        "process group 'no-such-group' cannot be resolved in this process" in r for r in launches
    )


def _call(target: Any, args: tuple[Any, ...], val: Any) -> torch.fx.Node:
    g = torch.fx.Graph()
    _, (x,) = fake_inputs(((4,), CUDA))
    ph = g.placeholder("x")
    ph.meta["val"] = x
    node = g.call_function(target, (ph, *args))
    node.meta["val"] = val if val is not None else x
    g.output(node)
    return node


@pytest.mark.parametrize(
    ("target", "args", "says"),
    [
        (
            "c10d_functional.all_reduce",
            ("sum", "", [0], 1),
            "legacy functional collective names its group by tag and ranks",
        ),
        (
            "_dtensor.shard_dim_alltoall",
            (0, 0, "0"),
            "a _dtensor op runs its collective and waits for it inside the op",
        ),
        (
            "c10d.barrier",
            (),
            "an in-place c10d collective hands back a Work object",
        ),
    ],
)
def test_other_collective_namespaces_stay_outside_with_their_reason(
    group: str, capturable: None, target: str, args: tuple[Any, ...], says: str
) -> None:
    import torch.distributed._functional_collectives
    import torch.distributed.tensor  # registers the _dtensor ops

    namespace, name = target.split(".")
    node = _call(getattr(getattr(torch.ops, namespace), name).default, args, None)
    reason = classify_node(node, torch.device("cuda", 0))
    assert reason is not None and reason.kind is CudagraphRefusalKind.COLLECTIVE
    assert says in reason.explanation


def test_a_collective_waited_on_elsewhere_and_a_wait_on_an_input_stay_outside(
    group: str, capturable: None
) -> None:
    def f(x: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = funcol.all_reduce(x * 2, "sum", group)  # returned unwaited
        done = funcol.wait_tensor(pending)  # its collective ran in another graph
        return out, done + 1

    gm, inputs = trace_fake(f, ((4,), CUDA), ((4,), CUDA))
    plan = plan_graph(gm, inputs, (), CudagraphOptions(), name="test")
    reasons = _collective_reasons(plan)
    assert any("its result is not waited on in this graph" in r for r in reasons), reasons
    assert any("waits on a collective issued outside this graph" in r for r in reasons), reasons
    assert [s.captured for s in plan.segments] == [True, False, True]


def test_a_collective_split_from_its_wait_is_refused_with_its_wait(
    group: str, capturable: None
) -> None:
    """An uncaptured ordered node between a collective and its (ordered) wait puts
    them in different segments: both stay outside, saying why, and the rest is
    captured."""
    mark_non_capturable(torch.ops.aten.add_, "stands in for a host op")
    try:

        def f(x: torch.Tensor, s: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
            gathered = funcol.all_gather_into_tensor(s, 1, group)
            counter.add_(1)
            return x @ funcol.wait_tensor(gathered)

        gm, inputs = trace_fake(f, ((4, 4), CUDA), ((4, 4), CUDA), ((1,), CUDA))
        plan = plan_graph(gm, inputs, (1,), CudagraphOptions(), name="test")
    finally:
        unmark_non_capturable(torch.ops.aten.add_)
    seg_of = {n: s for s in plan.segments for n in s.nodes}
    launch = next(n for n in seg_of if n.startswith("all_gather"))
    wait = next(n for n in seg_of if n.startswith("wait_tensor"))
    assert not seg_of[launch].captured and not seg_of[wait].captured
    split = [r for s in plan.segments for r in s.reasons if "different segments" in r.explanation]
    assert all(r.kind is CudagraphRefusalKind.COLLECTIVE for r in split)
    assert {r.op for r in split} == {
        "_c10d_functional.all_gather_into_tensor.default",
        "_c10d_functional.wait_tensor.default",
    }
    assert any(s.captured and any(n.startswith("mm") for n in s.nodes) for s in plan.segments)


def test_a_wait_of_a_refused_collective_is_refused_with_it(group: str, capturable: None) -> None:
    """A collective refused by any rule (here: marked by the user) takes its wait along."""
    mark_non_capturable(funcol.all_reduce, "user says no")
    try:
        gm, inputs = trace_fake(
            lambda x: funcol.wait_tensor(funcol.all_reduce(x * 2, "sum", group)) + 1,
            ((4,), CUDA),
        )
        plan = plan_graph(gm, inputs, (), CudagraphOptions(), name="test")
    finally:
        unmark_non_capturable(funcol.all_reduce)
    reasons = {r.op: r for s in plan.segments for r in s.reasons}
    assert reasons["_c10d_functional.all_reduce.default"].explanation == "user says no"
    wait = reasons["_c10d_functional.wait_tensor.default"]
    assert wait.kind is CudagraphRefusalKind.COLLECTIVE
    assert "stays uncaptured" in wait.explanation


# --- the host runtime -------------------------------------------------------------------


def _runtime(group: str, capture: bool, cap: HostCapturer) -> tuple[CudagraphRuntime, list[Any]]:
    shards = [torch.randn(WIDTH, WIDTH) / WIDTH**0.5 for _ in range(LAYERS)]
    example = [torch.randn(BATCH, WIDTH), *shards]
    gm = trace_real(gathered(group), *example)
    plan = plan_graph(
        gm,
        example,
        tuple(range(1, LAYERS + 1)),
        CudagraphOptions(capture_collectives=capture),
        name="forward",
        device=CPU,
    )
    run = build_runtime(plan, gm, example_inputs=example, capturer=cap, pool=MemoryPool(object()))
    return run, shards


def _captured(run: CudagraphRuntime) -> list[CapturedSegment]:
    return [s for s in run._stats if isinstance(s, CapturedSegment)]  # type: ignore[attr-defined]


def _copied_shapes(run: CudagraphRuntime) -> list[tuple[int, ...]]:
    return [
        tuple(b.shape)
        for seg in _captured(run)
        for table in seg._tables.values()
        for rec in table.recordings
        for b in rec.bufs
    ]


def _steps(group: str, run: CudagraphRuntime, shards: list[torch.Tensor], steps: int) -> None:
    eager = gathered(group)
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH)
        torch.testing.assert_close(run([x, *shards])[0], eager(x, *shards))
        with torch.no_grad():
            for s in shards:
                s.add_(0.01)  # the optimizer's in-place step


def test_captured_collectives_record_one_segment_without_copying_gathered_weights(
    group: str, capturable: None
) -> None:
    cap = HostCapturer()
    run, shards = _runtime(group, True, cap)
    _steps(group, run, shards, steps=5)
    (seg,) = _captured(run)
    assert seg.stats().recordings == 1 and cap.captures == 1 and cap.replays == 4
    # the gathered weights are the capture's own intermediates: only the batch is copied in
    assert _copied_shapes(run) == [(BATCH, WIDTH)]


def test_uncaptured_collectives_split_the_graph_and_copy_each_gathered_weight_in(
    group: str, capturable: None
) -> None:
    """The same graph with the option off: what capturing collectives removes."""
    cap = HostCapturer()
    run, shards = _runtime(group, False, cap)
    _steps(group, run, shards, steps=5)
    assert len(_captured(run)) == LAYERS
    assert _copied_shapes(run).count((WIDTH, WIDTH)) == LAYERS


def test_wait_through_getitem_of_a_coalesced_collective_pairs_with_it(
    group: str, capturable: None
) -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        outs = funcol.all_gather_into_tensor_coalesced([a, b], 1, group)
        return funcol.wait_tensor(outs[0]) + funcol.wait_tensor(outs[1])

    gm, inputs = trace_fake(f, ((4,), CUDA), ((4,), CUDA))
    assert any(n.target is operator.getitem for n in gm.graph.nodes)
    plan = plan_graph(gm, inputs, (), CudagraphOptions(), name="test")
    assert [(s.captured, s.reasons) for s in plan.segments] == [(True, ())]
