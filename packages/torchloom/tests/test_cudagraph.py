"""The CUDA-graph stage end to end on CPU: ``HostCapturer`` stands in for CUDA
graphs (a replay overwrites the recorded outputs in place), so planning,
segment codegen, the runtime and the report are checked against eager
without a GPU. The GPU versions live in tests_integration/test_cudagraph_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _train import train_like_eager

import loom_cudagraph
import torchloom
from torchloom import Pipeline
from torchloom._cudagraph import PlanOutcome, StoredPlan
from torchloom._values import GraphKind

CG = {"codegen": "eager", "cudagraphs": True}


def _host(capturer: loom_cudagraph.HostCapturer) -> Pipeline:
    """A pipeline that captures host graphs with ``capturer`` (CPU stands in for CUDA)."""
    return Pipeline(capturer=capturer, cudagraph_device="cpu")


@pytest.fixture
def host_stage() -> Iterator[loom_cudagraph.HostCapturer]:
    """A fresh HostCapturer; tests compile with ``backend=_host(host_stage)``."""
    capturer = loom_cudagraph.HostCapturer()
    torchloom.reset()
    loom_cudagraph.reset_skip_counts()
    yield capturer
    torchloom.reset()


@pytest.fixture
def sin_is_host_op() -> Iterator[None]:
    loom_cudagraph.mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
    yield
    loom_cudagraph.unmark_non_capturable(torch.ops.aten.sin)


def _segments(area_entries: Any) -> list[tuple[str, bool]]:
    return [(e.get("graph"), e.get("captured")) for e in area_entries if e.kind == "segment"]


def test_inference_replays_match_eager(host_stage: loom_cudagraph.HostCapturer) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) * 2

    compiled = torch.compile(f, backend=_host(host_stage), options=CG)
    w = torch.randn(4, 4)
    for _ in range(5):
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x, w), f(x, w))
    assert host_stage.captures >= 1 and host_stage.replays >= 3
    entries = torchloom.report().entries("cudagraph")
    segs = _segments(entries)
    assert segs and all(captured for _, captured in segs)
    recordings = [e for e in entries if e.kind == "recording"]
    assert recordings and recordings[-1].get("recordings") >= 1
    assert "pool bytes" in recordings[-1].message


def test_training_step_matches_eager_outputs_and_gradients(
    host_stage: loom_cudagraph.HostCapturer, sin_is_host_op: None
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).sin().sum()

    compiled = torch.compile(lambda x: step(model, x), backend=_host(host_stage), options=CG)
    for _ in range(4):
        x = torch.randn(3, 4)
        loss = compiled(x)
        loss.backward()
        ref_loss = step(ref, x)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    graphs = {g for g, _ in _segments(torchloom.report().entries("cudagraph"))}
    assert any("forward" in g for g in graphs) and any("backward" in g for g in graphs)
    assert [captured for _, captured in _segments(torchloom.report().entries("cudagraph"))].count(
        False
    ) >= 1
    assert host_stage.replays > 0


def test_gradient_accumulation_over_several_forwards(
    host_stage: loom_cudagraph.HostCapturer,
) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    compiled = torch.compile(lambda x: lin(x).tanh().sum(), backend=_host(host_stage), options=CG)
    for _ in range(3):
        xs = [torch.randn(2, 4) for _ in range(3)]
        losses = [compiled(x) for x in xs]  # three forwards before any backward
        sum(losses).backward()
        sum(ref(x).tanh().sum() for x in xs).backward()
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_or_error_raises_naming_the_op(
    host_stage: loom_cudagraph.HostCapturer, sin_is_host_op: None
) -> None:
    compiled = torch.compile(
        lambda x: (x + 1).sin() * 2,
        backend=_host(host_stage),
        options={**CG, "cudagraph_or_error": True},
    )
    with pytest.raises(Exception, match=r"aten\.sin\.default.*user_marked"):
        compiled(torch.randn(3))


def test_or_error_environment_variable(
    host_stage: loom_cudagraph.HostCapturer, sin_is_host_op: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHLOOM_CUDAGRAPH_OR_ERROR", "1")
    compiled = torch.compile(lambda x: (x + 1).sin() * 2, backend=_host(host_stage), options=CG)
    with pytest.raises(Exception, match=r"cudagraph_or_error"):
        compiled(torch.randn(3))


def test_options_map_reduce_overhead_to_cudagraphs() -> None:
    opts = torchloom.resolve_options(mode="reduce-overhead", env={})
    assert opts.cudagraphs and opts.cudagraph_max_recording == 5
    env = {"TORCHLOOM_CUDAGRAPH_OR_ERROR": "1", "TORCHLOOM_CUDAGRAPH_MAX_SHAPES": "3"}
    opts = torchloom.resolve_options(env=env)
    assert opts.cudagraph_or_error and opts.cudagraph_max_shapes == 3


def test_without_cudagraphs_the_stage_does_nothing(host_stage: loom_cudagraph.HostCapturer) -> None:
    compiled = torch.compile(
        lambda x: x * 2 + 1, backend=_host(host_stage), options={"codegen": "eager"}
    )
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    assert host_stage.captures == 0
    assert torchloom.report().entries("cudagraph") == ()


@pytest.mark.inductor
def test_inductor_codegen_per_segment_matches_eager(
    host_stage: loom_cudagraph.HostCapturer, sin_is_host_op: None
) -> None:
    # Inductor compiles each segment of one AOT graph; strides and output
    # metadata must stay consistent across segments and with AOTAutograd.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(
        lambda x: model(x).sin().sum(), backend=_host(host_stage), options={"cudagraphs": True}
    )
    for _ in range(3):
        x = torch.randn(3, 4)
        loss = compiled(x)
        loss.backward()
        ref_loss = ref(x).sin().sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    segs = _segments(torchloom.report().entries("cudagraph"))
    assert [c for g, c in segs if "forward" in g] == [True, False, True]
    assert host_stage.replays > 0


def test_random_holding_patterns_never_corrupt_outputs_or_gradients(
    host_stage: loom_cudagraph.HostCapturer,
) -> None:
    # Random interleavings of forwards, kept or dropped outputs and backwards:
    # every kept output and every gradient must equal eager's.
    import random

    rng = random.Random(0)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    compiled = torch.compile(lambda x: lin(x).tanh(), backend=_host(host_stage), options=CG)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(40):
        action = rng.choice(["keep", "drop", "pending", "backward"])
        x = torch.randn(2, 4)
        if action == "backward" and pending:
            sum(o.sum() for o, _ in pending).backward()
            sum(ref(xx).tanh().sum() for _, xx in pending).backward()
            pending.clear()
            torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
            continue
        out = compiled(x)
        if action == "keep":
            kept.append((out.detach(), x))
        elif action == "pending":
            pending.append((out, x))
        del out
    with torch.no_grad():
        for out, x in kept:
            torch.testing.assert_close(out, ref(x).tanh())
    assert host_stage.replays > 10


def test_cache_hit_reproduces_the_plan_and_its_skips(
    host_stage: loom_cudagraph.HostCapturer,
    sin_is_host_op: None,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())

    def compile_and_train() -> tuple[list[str], dict[Any, int], list[str]]:
        torchloom.reset()
        loom_cudagraph.reset_skip_counts()
        f = torch.compile(
            lambda x: lin(x).sin().sum(),
            backend=_host(host_stage),
            options={"cudagraphs": True, "codegen": "eager"},
        )
        for _ in range(4):
            x = torch.randn(2, 4)
            loss = f(x)
            loss.backward()
            want = ref(x).sin().sum()
            want.backward()
            torch.testing.assert_close(loss, want)
            torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
        entries = torchloom.report().entries()
        cache = [e.kind for e in entries if e.area == "cache"]
        segments = [e.message for e in entries if e.area == "cudagraph" and e.kind == "segment"]
        return cache, loom_cudagraph.skip_counts(), segments

    cold = compile_and_train()
    replays = host_stage.replays
    warm = compile_and_train()
    assert "stored" in cold[0] and "hit" in warm[0]
    assert cold[1] == warm[1] == {loom_cudagraph.CudagraphRefusalKind.USER_MARKED: 1}
    assert cold[2] == warm[2]
    assert host_stage.replays > replays  # the cached graph runs captured segments


def test_graph_with_nothing_capturable_still_reports_its_skip(
    host_stage: loom_cudagraph.HostCapturer, sin_is_host_op: None
) -> None:
    compiled = torch.compile(lambda x: x.sin(), backend=_host(host_stage), options=CG)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x.sin())
    assert loom_cudagraph.skip_counts() == {loom_cudagraph.CudagraphRefusalKind.USER_MARKED: 1}
    assert host_stage.captures == 0


@pytest.mark.parametrize("outcome", list(PlanOutcome))
def test_a_stored_plan_keeps_its_outcome_through_the_cache_payload(outcome: PlanOutcome) -> None:
    stored = StoredPlan(GraphKind.BACKWARD, outcome, '{"graph": "g"}')
    payload = stored.to_payload()
    # The payload is plain strings (the artifact stores it as data, not as enum members).
    assert dict(payload) == {"kind": "backward", "outcome": outcome.value, "plan": '{"graph": "g"}'}
    assert StoredPlan.from_payload(payload) == stored


@pytest.mark.parametrize("via", ["pipeline", "loom"])
def test_dynamo_reset_drops_the_captured_graphs(
    host_stage: loom_cudagraph.HostCapturer, via: str
) -> None:
    """``torch._dynamo.reset()`` resets the backends it used: loom drops its graphs
    (Dynamo keeps the compiled function alive as a global of this module), and a
    function still held records again."""
    import gc
    import weakref

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x) * 2

    x = torch.randn(4, 4)
    compiled = torch.compile(f, backend=_host(host_stage), options=CG)
    for _ in range(3):
        compiled(x)
    assert host_stage.captures == 1
    (runtime,) = torchloom._cudagraph._runtimes  # built since the fixture's reset
    (seg,) = (s for s in runtime._stats if isinstance(s, loom_cudagraph._segment.CapturedSegment))
    (rec,) = (r for t in seg._tables.values() for r in t.recordings)
    graph = weakref.ref(rec.graph)
    del rec
    if via == "loom":
        # the registered backend's own reset (Dynamo resets the backends it used)
        torchloom.loom_backend.reset()  # type: ignore[attr-defined]
    else:
        torch._dynamo.reset()
    gc.collect()
    assert graph() is None
    assert seg._tables == {}
    assert runtime.stats().segments[0].recordings == 1  # the history stays in the stats


class _Gathered(torch.nn.Module):
    """Eight layers whose weights are "gathered" from a shard (``cos`` marked as a
    collective stands in for FSDP2's all-gather) before each layer's compute."""

    def __init__(self, layers: int = 8, width: int = 32) -> None:
        super().__init__()
        self.shards = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for shard in self.shards:
            x = torch.tanh(x @ shard.cos().T)
        return x.square().mean()


def test_gathered_layers_record_each_segment_once_and_match_eager(
    host_stage: loom_cudagraph.HostCapturer,
) -> None:
    """A forward split at every "all-gather" (AOTAutograd's backward reads the saved
    weights, one segment): each captured segment records once and replays on every
    later step (a forward output that the backward's host graph held, or that it
    passed on, made the forward record again on every step), equal to eager."""
    loom_cudagraph.mark_non_capturable(
        torch.ops.aten.cos,
        "stands in for an all-gather",
        kind=loom_cudagraph.CudagraphRefusalKind.COLLECTIVE,
    )
    try:
        torch.manual_seed(0)
        model, ref = _Gathered(), _Gathered()
        ref.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend=_host(host_stage), options=CG)
        train_like_eager(compiled, model, ref, (torch.randn(4, 32) for _ in range(5)))
    finally:
        loom_cudagraph.unmark_non_capturable(torch.ops.aten.cos)
    entries = torchloom.report().entries("cudagraph")
    captured = [s for s in _segments(entries) if s[1]]
    recordings = [e for e in entries if e.kind == "recording"]
    assert len(captured) == 9  # a segment per layer in the forward, one backward
    assert len(recordings) == len(captured) == host_stage.captures
    forward = [r for r in _recordings() if "forward" in r.table.owner.spec.name]
    forward.sort(key=lambda r: int(r.table.owner.spec.name.rsplit("_", 1)[1]))
    assert len(forward) == 8
    # layers 1-7 save a view of their gathered weight (``w.T``) for the backward, so
    # each keeps its weight's buffer of its own (a shared one would be overwritten
    # under the saved view); layer 0 saves none (its input needs no gradient) and
    # reads its weight from a buffer of the pool's arena
    weight = [
        next(i for i, b in zip(r.copy_idx, r.bufs, strict=True) if b.shape == (32, 32))
        for r in forward
    ]
    lent = [
        any(b.untyped_storage()._cdata in r.lent for b in r.bufs if b.shape == (32, 32))
        for r in forward
    ]
    assert lent == [True] + [False] * 7
    aliased = [w in r.table.aliased for w, r in zip(weight, forward, strict=True)]
    assert aliased == [False] + [True] * 7


def _recordings() -> list[Any]:
    from loom_cudagraph._live import live_runtimes
    from loom_cudagraph._segment import CapturedSegment

    return [
        r
        for run in live_runtimes
        if isinstance(run, loom_cudagraph.CudagraphRuntime)
        for s in run._stats
        if isinstance(s, CapturedSegment)
        for t in s._tables.values()
        for r in t.recordings
    ]
