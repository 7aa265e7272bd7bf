"""Copy-in buffers shared by the recordings of one pool (``_arena``), on the host.

The FSDP2-like graphs gather each layer's weight (``cos`` marked as a collective
stands in for the all-gather, ``sin`` for the reduce-scatter) and compute with
it: every captured layer copies its gathered weight in, and with one buffer per
recording the copies would hold the whole model's weights twice (forward and
backward) for as long as the recordings live.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _cg_helpers import trace_real

import loom_cudagraph._segment as segment_mod
from loom_cudagraph import (
    CudagraphOptions,
    CudagraphRefusalKind,
    CudagraphRuntime,
    HostCapturer,
    MemoryPool,
    build_runtime,
    mark_non_capturable,
    plan_graph,
    unmark_non_capturable,
)
from loom_cudagraph._arena import CopyArena
from loom_cudagraph._segment import CapturedSegment
from loom_cudagraph._torch_compat import storage_id

CPU = torch.device("cpu")
LAYERS, WIDTH, BATCH = 8, 64, 4
#: one layer's gathered weight
LAYER_BYTES = WIDTH * WIDTH * 4


@pytest.fixture
def collectives() -> Iterator[None]:
    mark_non_capturable(
        torch.ops.aten.cos, "stands in for an all-gather", kind=CudagraphRefusalKind.COLLECTIVE
    )
    mark_non_capturable(
        torch.ops.aten.sin, "stands in for a reduce-scatter", kind=CudagraphRefusalKind.COLLECTIVE
    )
    yield
    unmark_non_capturable(torch.ops.aten.cos)
    unmark_non_capturable(torch.ops.aten.sin)


def forward(x: torch.Tensor, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each layer's output (the last is the result; all are saved for the backward)."""
    ys = []
    for s in shards:
        w = s.cos()  # the all-gather
        x = torch.tanh(x @ w.T)
        ys.append(x)
    return tuple(ys)


def backward(g: torch.Tensor, x0: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The input's gradient, then each shard's "reduce-scattered" weight gradient; the
    weights are gathered again, as FSDP2 does after resharding."""
    ys, shards = rest[:LAYERS], rest[LAYERS:]
    grads = []
    for i in reversed(range(LAYERS)):
        w = shards[i].cos()
        pre = g * (1 - ys[i] * ys[i])
        dw = pre.T @ (ys[i - 1] if i else x0)
        grads.append(dw.sin())  # the reduce-scatter
        g = pre @ w
    return (g, *reversed(grads))


def _runtime(
    fn: Any, inputs: list[torch.Tensor], static: tuple[int, ...], pool: MemoryPool, cap: Any
) -> CudagraphRuntime:
    gm = trace_real(fn, *inputs)
    plan = plan_graph(gm, inputs, static, CudagraphOptions(), name=fn.__name__, device=CPU)
    return build_runtime(plan, gm, example_inputs=inputs, capturer=cap, pool=pool)


def _segments(*runs: CudagraphRuntime) -> list[CapturedSegment]:
    return [s for r in runs for s in r._stats if isinstance(s, CapturedSegment)]  # type: ignore[attr-defined]


def copy_in_bytes(*runs: CudagraphRuntime) -> int:
    """Bytes of the distinct copy-in buffers the live recordings of ``runs`` keep."""
    bufs = {
        storage_id(b): b.untyped_storage().nbytes()
        for seg in _segments(*runs)
        for table in seg._tables.values()
        for rec in table.recordings
        for b in rec.bufs
    }
    return sum(bufs.values())


def _assert_equal(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def _train(steps: int, cap: Any = None) -> tuple[CudagraphRuntime, CudagraphRuntime]:
    """``steps`` forward and backward calls through two runtimes sharing a pool (the
    shards updated in place between steps, as an optimizer does), each checked
    against eager."""
    cap = cap or HostCapturer()
    pool = MemoryPool(object())
    shards = [torch.randn(WIDTH, WIDTH) / WIDTH**0.5 for _ in range(LAYERS)]
    x, g = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    fw_in = [x, *shards]
    fw = _runtime(forward, fw_in, tuple(range(1, LAYERS + 1)), pool, cap)
    ys = forward(*fw_in)
    bw_in = [g, x, *ys, *shards]
    bw = _runtime(backward, bw_in, tuple(range(2 + LAYERS, 2 + 2 * LAYERS)), pool, cap)
    del ys, bw_in, fw_in
    for _ in range(steps):
        x, g = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        want_ys = forward(x, *shards)
        want = backward(g, x, *want_ys, *shards)
        ys = fw([x, *shards])
        _assert_equal(ys, want_ys)
        args = [g, x, *ys, *shards]
        del ys  # the backward's list holds the saved activations alone, as AOTAutograd's
        grads = bw(args)
        _assert_equal(grads, want)
        del grads
        with torch.no_grad():
            for s in shards:
                s.add_(0.01)  # the optimizer's in-place step
    return fw, bw


def test_gathered_weights_share_copy_in_buffers_across_layers_and_passes(
    collectives: None,
) -> None:
    fw, bw = _train(steps=5)
    segs = _segments(fw, bw)
    assert len(segs) >= 2 * LAYERS  # a captured segment per layer and pass at least
    assert all(s.stats().recordings == 1 for s in segs)
    # every layer's segment copies its gathered weight in ...
    copied = [i for s in segs for t in s._tables.values() for r in t.recordings for i in r.copy_idx]
    assert len(copied) >= 2 * LAYERS
    # ... into one buffer for the whole pool (plus the batch-sized inputs), not 16
    held = copy_in_bytes(fw, bw)
    assert LAYER_BYTES <= held <= 2 * LAYER_BYTES, held


def test_results_equal_eager_on_every_step_with_shared_buffers(collectives: None) -> None:
    cap = HostCapturer()
    fw, bw = _train(steps=6, cap=cap)
    segs = len(_segments(fw, bw))
    assert cap.captures == segs  # recorded once (step 2), replayed since
    assert cap.replays == segs * 5
    assert fw.plan.graph == "forward" and bw.plan.graph == "backward"


def _view_then_layer(
    x: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A captured segment hands out a view of its copied-in input (``w0.T``), and
    the next one copies in an input of the same shape."""
    w0 = s0.cos()
    h = torch.tanh(x @ w0)
    w1 = s1.cos()
    return torch.tanh(h @ w1), w0.T


def test_an_input_an_output_views_keeps_a_buffer_of_its_own(collectives: None) -> None:
    cap = HostCapturer()
    pool = MemoryPool(object())
    s0, s1 = torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, WIDTH)
    run = _runtime(_view_then_layer, [torch.randn(BATCH, WIDTH), s0, s1], (1, 2), pool, cap)
    for _ in range(4):
        x = torch.randn(BATCH, WIDTH)
        y, w0t = run([x, s0, s1])
        want_y, want_w0t = _view_then_layer(x, s0, s1)
        torch.testing.assert_close(y, want_y)
        torch.testing.assert_close(w0t, want_w0t)  # not s1.cos() written over it
        del y, w0t
    first, second = _segments(run)
    assert first._tables[None].aliased and not second._tables[None].aliased
    (buf_first,) = (
        b
        for r in first._tables[None].recordings
        for b in r.bufs
        if b.dim() == 2 and b.shape[0] == WIDTH
    )
    (buf_second,) = (b for r in second._tables[None].recordings for b in r.bufs)
    assert storage_id(buf_first) != storage_id(buf_second)


def test_an_output_found_on_a_shared_buffer_after_capture_turns_the_segment_off(
    collectives: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up said no output aliases an input; the capture says otherwise:
    the segment runs uncaptured from then on, with the right results."""
    monkeypatch.setattr(segment_mod, "_aliased_inputs", lambda warm, outs: frozenset())
    cap = HostCapturer()
    s0, s1 = torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, WIDTH)
    run = _runtime(
        _view_then_layer, [torch.randn(BATCH, WIDTH), s0, s1], (1, 2), MemoryPool(object()), cap
    )
    for _ in range(4):
        x = torch.randn(BATCH, WIDTH)
        y, w0t = run([x, s0, s1])
        want_y, want_w0t = _view_then_layer(x, s0, s1)
        torch.testing.assert_close(y, want_y)
        torch.testing.assert_close(w0t, want_w0t)
    first = run.stats().segments[1]
    assert not first.captured
    (reason,) = first.reasons
    assert reason.kind is CudagraphRefusalKind.CAPTURE_FAILED
    assert "copy-in buffer shared" in reason.explanation


# --- the arena itself ----------------------------------------------------------------------


def test_arena_lends_distinct_buffers_within_a_call_and_the_same_across_calls() -> None:
    arena = CopyArena()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    first = arena.lend([a, b, torch.randn(5)])
    assert len({storage_id(t) for t in first}) == 3
    again = arena.lend([b])
    assert storage_id(again[0]) == storage_id(first[0])
    assert arena.held_bytes() == 2 * 3 * 4 * 4 + 5 * 4
    other = arena.lend([a.T.contiguous().T])  # another stride: another buffer
    assert storage_id(other[0]) not in {storage_id(t) for t in first}


def test_arena_buffers_die_with_the_last_recording_that_reads_them() -> None:
    arena = CopyArena()
    (buf,) = arena.lend([torch.randn(8)])
    ptr = storage_id(buf)
    del buf
    assert arena.held_bytes() == 0
    (fresh,) = arena.lend([torch.randn(8)])
    assert fresh.shape == (8,) and arena.held_bytes() == 32
    del fresh, ptr
