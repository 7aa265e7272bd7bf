"""loom's CUDA graphs end to end on a GPU, each behaviour compared with eager:
capture and replay, segments around host ops, meta tensors, static inputs that
move, outputs kept across calls, training (gradient accumulation, forwards
without backward, interleaved functions), input mutation, dynamic shapes, RNG,
or_error and the report. Run through scripts/gpu_tier.sh (marker ``gpu``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import loom_cudagraph
import torchloom
from torchloom import cudagraph_stats

pytestmark = pytest.mark.gpu

CG: dict[str, Any] = {"cudagraphs": True}
CUDA = "cuda"


_first_runtime = 0


@pytest.fixture(autouse=True)
def _fresh_counts() -> Iterator[None]:
    global _first_runtime
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA device")
    loom_cudagraph.reset_skip_counts()
    _first_runtime = len(cudagraph_stats())
    yield
    loom_cudagraph.reset_skip_counts()


def _stats() -> list[loom_cudagraph.SegmentStats]:
    """Segments of the CUDA-graph runtimes built by the current test."""
    return [s for r in cudagraph_stats()[_first_runtime:] for s in r.segments]


def _compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    return torch.compile(fn, backend="loom", options={**CG, **options})


def _segments() -> list[tuple[str, bool]]:
    return [
        (e.get("graph"), e.get("captured"))
        for e in torchloom.report().entries("cudagraph")
        if e.kind == "segment"
    ]


def _replays() -> int:
    return sum(s.replays for s in _stats())


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_mlp_inference_replays_match_eager(codegen: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(CUDA).eval()
    compiled = _compile(model, codegen=codegen)
    before = _replays()
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 32, device=CUDA)
            torch.testing.assert_close(compiled(x), model(x))
    assert _replays() - before >= 4
    assert _segments() and all(captured for _, captured in _segments())
    assert loom_cudagraph.skip_counts() == {}


def test_reduce_overhead_mode_captures() -> None:
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="loom", mode="reduce-overhead")
    for _ in range(4):
        x = torch.randn(16, device=CUDA)
        torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)
    assert all(captured for _, captured in _segments())
    assert _replays() >= 2


def test_meta_tensor_beside_cuda_tensor_is_captured_without_skip() -> None:
    def foobar(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, y * 3

    compiled = _compile(foobar)
    t = torch.empty((1, 16, 128, 128), device="meta")
    for _ in range(3):
        y = torch.rand(64, device=CUDA)
        out_t, out_y = compiled(t, y)
        assert out_t.device.type == "meta" and out_t.shape == t.shape
        torch.testing.assert_close(out_y, y * 3)
    assert loom_cudagraph.skip_counts() == {}
    assert all(captured for _, captured in _segments())


def test_cpu_op_in_the_middle_keeps_captured_segments_around_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x1 = x + 1
        y1 = y + 1
        y_cpu = y1.cpu() + 1
        z = x @ y
        return x1 + y1 + z + y_cpu.cuda()

    compiled = _compile(f)
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for _ in range(5):
            x, y = torch.randn(2, 2, device=CUDA), torch.randn(2, 2, device=CUDA)
            torch.testing.assert_close(compiled(x, y), f(x, y))
    assert [captured for _, captured in _segments()] == [True, False, True]
    assert loom_cudagraph.skip_counts().get(loom_cudagraph.CudagraphRefusalKind.DEVICE_COPY, 0) >= 1
    assert any("device_copy" in r.getMessage() for r in caplog.records)
    assert _replays() >= 6


def test_parameter_replaced_every_call_records_again_then_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lin = nn.Linear(8, 8).to(CUDA)
    compiled = _compile(lambda x: lin(x).relu(), cudagraph_max_recording=3)
    keep = []  # every weight stays alive, so each one has a new address
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"), torch.no_grad():
        for _ in range(10):
            lin.weight = nn.Parameter(torch.randn(8, 8, device=CUDA))  # a new tensor each call
            keep.append(lin.weight)
            x = torch.randn(4, 8, device=CUDA)
            torch.testing.assert_close(compiled(x), lin(x).relu())
    budget = [r.getMessage() for r in caplog.records if "recording_budget" in r.getMessage()]
    assert len(budget) == 1
    assert "changed its data pointer from 0x" in budget[0]
    assert max(s.recordings for s in _stats()) == 3
    assert loom_cudagraph.skip_counts() == {loom_cudagraph.CudagraphRefusalKind.RECORDING_BUDGET: 1}


def test_outputs_kept_across_many_calls_stay_correct() -> None:
    compiled = _compile(lambda x: (x * 2, x.sin()))
    kept, want = [], []
    for _ in range(20):
        x = torch.randn(32, device=CUDA)
        kept.append(compiled(x))
        want.append((x * 2, x.sin()))
    for got, ref in zip(kept, want, strict=True):
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])


def test_rebinding_loop_double_buffers_without_copies() -> None:
    compiled = _compile(lambda x: x.exp() + 1)
    out = None
    for _ in range(10):
        x = torch.randn(32, device=CUDA)
        out = compiled(x)  # the previous ``out`` is alive while this call runs
        torch.testing.assert_close(out, x.exp() + 1)
    (seg,) = _stats()
    assert seg.copied_out == () and seg.recordings == 2


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(CUDA)


def _assert_grads(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_training_steps_match_eager(codegen: str) -> None:
    model, ref = _mlp(), _mlp()
    compiled = _compile(model, codegen=codegen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(6):
        x = torch.randn(8, 16, device=CUDA)
        for o, fn in ((opt, compiled), (ref_opt, ref)):
            o.zero_grad(set_to_none=True)
            loss = fn(x).pow(2).mean()
            loss.backward()
        _assert_grads(model, ref)
        opt.step()
        ref_opt.step()
    graphs = {g for g, _ in _segments()}
    assert any("forward" in g for g in graphs) and any("backward" in g for g in graphs)
    assert _replays() >= 6


def test_gradient_accumulation_over_several_forwards() -> None:
    model, ref = _mlp(), _mlp()
    compiled = _compile(model)
    for _ in range(4):
        xs = [torch.randn(8, 16, device=CUDA) for _ in range(3)]
        sum(compiled(x).sum() for x in xs).backward()
        sum(ref(x).sum() for x in xs).backward()
        _assert_grads(model, ref)


def test_forward_without_backward_then_training() -> None:
    model, ref = _mlp(), _mlp()
    compiled = _compile(model)
    dropped = [compiled(torch.randn(8, 16, device=CUDA)) for _ in range(3)]  # never backward
    x = torch.randn(8, 16, device=CUDA)
    compiled(x).sum().backward()
    ref(x).sum().backward()
    _assert_grads(model, ref)
    assert len(dropped) == 3


def test_interleaved_calls_of_two_compiled_functions() -> None:
    a, b = _mlp(0), _mlp(1)
    ref_a, ref_b = _mlp(0), _mlp(1)
    ca, cb = _compile(a), _compile(b)
    for _ in range(5):
        x = torch.randn(8, 16, device=CUDA)
        ya = ca(x)
        yb = cb(x)
        (ya.sum() + yb.sum()).backward()
        (ref_a(x).sum() + ref_b(x).sum()).backward()
        torch.testing.assert_close(ya, ref_a(x))
        torch.testing.assert_close(yb, ref_b(x))
    _assert_grads(a, ref_a)
    _assert_grads(b, ref_b)


def test_buffer_mutation_in_training_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(CUDA)
    ref = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(CUDA)
    ref.load_state_dict(model.state_dict())
    compiled = _compile(model)
    for _ in range(5):
        x = torch.randn(16, 8, device=CUDA)
        compiled(x).sum().backward()
        ref(x).sum().backward()
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    _assert_grads(model, ref)


def test_mutated_user_input_is_updated_as_in_eager() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(y)
        return x * 2

    compiled = _compile(f)
    for _ in range(5):
        x, y = torch.randn(8, device=CUDA), torch.randn(8, device=CUDA)
        x_ref = x.clone()
        want = f(x_ref, y)
        torch.testing.assert_close(compiled(x, y), want)
        torch.testing.assert_close(x, x_ref)


def test_one_recording_per_shape_then_uncaptured_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    compiled = torch.compile(
        lambda x: x.cos() * 2,
        backend="loom",
        dynamic=True,
        options={**CG, "cudagraph_max_shapes": 2},
    )
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for n in (4, 5, 4, 5, 6, 6, 7, 4):
            x = torch.randn(n, device=CUDA)
            torch.testing.assert_close(compiled(x), x.cos() * 2)
    assert sum("dynamic_shape_budget" in r.getMessage() for r in caplog.records) == 1
    assert max(s.shapes for s in _stats()) == 2


def test_dropout_draws_like_uncaptured_compiled_code_and_fresh_each_call() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * 2, p=0.5, training=True)

    x = torch.ones(4096, device=CUDA)
    plain = torch.compile(f, backend="loom")
    torch.manual_seed(123)
    want = [plain(x).clone() for _ in range(5)]
    torch._dynamo.reset()
    graphs = _compile(f)
    torch.manual_seed(123)
    got = [graphs(x).clone() for _ in range(5)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert not torch.equal(got[2], got[3])  # replays draw fresh masks
    assert _replays() >= 3


def test_or_error_names_the_op_reason_and_line() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).cpu().cuda() * 2

    compiled = _compile(f, cudagraph_or_error=True)
    with pytest.raises(Exception, match=r"device_copy") as info:
        compiled(torch.randn(4, device=CUDA))
    message = str(info.value)
    # Inductor's decompositions may turn the copy into prims.device_put
    assert "aten._to_copy.default" in message or "prims.device_put" in message
    assert "test_cudagraph_e2e.py" in message


def test_report_shows_segments_recordings_and_pool_bytes() -> None:
    compiled = _compile(lambda x: (x @ x).relu())
    for _ in range(4):
        compiled(torch.randn(64, 64, device=CUDA))
    (runtime,) = cudagraph_stats()[_first_runtime:]
    (seg,) = runtime.segments
    assert seg.captured and seg.recordings >= 1 and seg.replays >= 2
    assert "segments" in runtime.format()
    assert _segments() == [(_segments()[0][0], True)]


# --- memory: the backward reuses what the forward's outputs leave behind ------------------


def _wide_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers).to(CUDA)


def _pool_bytes() -> dict[tuple[int, int], int]:
    """Bytes each private memory pool (a CUDA graph's) reserves, by pool id."""
    pools: dict[tuple[int, int], int] = {}
    for seg in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
        pid = tuple(seg["segment_pool_id"])
        if pid != (0, 0):
            pools[pid] = pools.get(pid, 0) + seg["total_size"]  # type: ignore[index]
    return pools  # type: ignore[return-value]


def _held_by_training(wrap: Callable[[nn.Module], Any]) -> tuple[int, int, list[torch.Tensor]]:
    """What four training steps hold beyond what the model held before: the bytes
    reserved by the memory pools they created plus the bytes still allocated outside
    them (the gradients), and, for the record, the growth of the whole reservation.

    The graphs' memory is the pools: the rest of ``memory_reserved()`` is the
    caching allocator's own, whose fragmentation depends on what ran earlier in
    the process (a gradient placed in a segment carved by an earlier tensor keeps
    the whole segment reserved after ``empty_cache``), so it is printed, not bounded.
    """
    import gc

    model = _wide_mlp()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    reserved, allocated, pools = (
        torch.cuda.memory_reserved(),
        torch.cuda.memory_allocated(),
        _pool_bytes(),
    )
    step = wrap(model)
    x = torch.randn(2048, 1024, device=CUDA, generator=None)
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        step(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    new_pools = sum(n for pid, n in _pool_bytes().items() if pid not in pools)
    held = new_pools + torch.cuda.memory_allocated() - allocated - sum(g.nbytes for g in grads)
    return held, torch.cuda.memory_reserved() - reserved, grads


def test_backward_recording_reuses_the_memory_of_saved_activations() -> None:
    torch.manual_seed(0)
    loom_held, loom_reserved, loom_grads = _held_by_training(_compile)
    by_graph = {r.graph: r.pool_bytes for r in cudagraph_stats()[_first_runtime:]}
    recordings = [(s.name, s.recordings, s.replays) for s in _stats()]
    fw = sum(b for g, b in by_graph.items() if "forward" in g)
    bw = sum(b for g, b in by_graph.items() if "backward" in g)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ro_held, ro_reserved, ro_grads = _held_by_training(
        lambda m: torch.compile(m, mode="reduce-overhead")
    )
    torch._dynamo.reset()
    mib = 2**20
    print(
        f"held: loom {loom_held / mib:.1f} MiB (forward pool {fw / mib:.1f}, backward "
        f"{bw / mib:.1f}), reduce-overhead {ro_held / mib:.1f} MiB; reserved growth: loom "
        f"{loom_reserved / mib:.1f} MiB, reduce-overhead {ro_reserved / mib:.1f} MiB; "
        f"(segment, recordings, replays): {recordings}"
    )
    for a, b in zip(loom_grads, ro_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # six 8 MiB activations (and six GELU inputs) are saved; without reuse the
    # backward needs its gradients' memory anew (24 MiB of weight gradients alone)
    # one recording per segment: a second one (an input read in place that moved)
    # goes to a pool of its own, which is what this test exists to rule out
    assert all(n == 1 for _, n, _ in recordings), recordings
    assert bw <= 0.25 * fw
    assert loom_held <= 1.05 * ro_held + 2**21


def test_dynamo_reset_gives_the_graphs_memory_back() -> None:
    """Dynamo keeps a compiled function alive (a global of its frame's module) after
    ``torch._dynamo.reset()``; the reset reaches loom's backend, whose graphs go, and
    their pools with them, as Inductor's CUDA graph trees go."""
    import gc

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = set(_pool_bytes())
    model = _wide_mlp()
    compiled = _compile(model)
    x = torch.randn(256, 1024, device=CUDA)
    for _ in range(3):
        compiled(x).sum().backward()
    torch.cuda.synchronize()
    assert set(_pool_bytes()) - before, "no pool was made: nothing was captured"
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    assert set(_pool_bytes()) - before == set()
    # still callable: the function records again
    torch.testing.assert_close(compiled(x), model(x))


def test_output_dropped_at_recording_but_held_later_is_not_overwritten() -> None:
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 256).to(CUDA), nn.Linear(256, 8).to(CUDA)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin1(x).relu()
        return lin2(h), h

    compiled = _compile(f)
    for _ in range(3):  # warm-up, recording, replay: the activation dropped each time
        y, h = compiled(torch.randn(32, 64, device=CUDA))
        del h
        y.sum().backward()
    x = torch.randn(32, 64, device=CUDA)
    y, h = compiled(x)  # now held across the backward
    want = lin1(x).relu().detach().clone()
    y.sum().backward()
    torch.testing.assert_close(h, want)
    y2, _ = compiled(torch.randn(32, 64, device=CUDA))
    y2.sum().backward()
    torch.testing.assert_close(h, want)  # still intact after one more step


# --- collectives: a 1-rank NCCL group's all-gather and all-reduce inside the graph -------


@pytest.fixture
def nccl_group() -> Iterator[Any]:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.fail("the gpu tier needs NCCL")
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device(CUDA, 0)
    )
    try:
        yield dist.group.WORLD
    finally:
        torchloom.reset()
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_nccl_collectives_are_captured_with_the_compute(nccl_group: Any, codegen: str) -> None:
    """Functional collectives of an NCCL group and their waits record into the graph
    (one segment, no skip) and replay equal to eager; with the option off they stay
    outside, each a ``collective`` skip."""
    import torch.distributed._functional_collectives as funcol

    def f(x: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        for shard in (s0, s1):
            w = funcol.all_gather_tensor(shard, 0, nccl_group)
            x = torch.tanh(x @ w.T)
        return funcol.all_reduce(x, "sum", nccl_group)

    shards = [torch.randn(64, 64, device=CUDA) / 8 for _ in range(2)]
    compiled = _compile(f, codegen=codegen)
    for _ in range(5):
        x = torch.randn(16, 64, device=CUDA)
        torch.testing.assert_close(compiled(x, *shards), f(x, *shards))
    assert [captured for _, captured in _segments()] == [True]
    assert loom_cudagraph.skip_counts() == {}
    (seg,) = _stats()
    assert seg.recordings == 1 and seg.replays >= 3

    torch._dynamo.reset()
    torchloom.reset()
    off = _compile(f, codegen=codegen, cudagraph_capture_collectives=False)
    for _ in range(3):
        x = torch.randn(16, 64, device=CUDA)
        torch.testing.assert_close(off(x, *shards), f(x, *shards))
    kinds = loom_cudagraph.skip_counts()
    assert kinds.get(loom_cudagraph.CudagraphRefusalKind.COLLECTIVE, 0) >= 3, kinds
