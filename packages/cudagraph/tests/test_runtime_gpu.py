"""The runtime's per-call path on a CUDA device (``CudaCapturer``): inputs at a
stable address read in place, moving inputs copied, outputs kept across calls,
the replay bound to ``CUDAGraph.replay`` and the ``record_calls`` probe.
Run through scripts/gpu_tier.sh (marker ``gpu``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _cg_helpers import trace_real

from loom_cudagraph import (
    CudagraphOptions,
    CudagraphRuntime,
    build_runtime,
    new_pool,
    plan_graph,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def compile_cuda(
    fn: Callable[..., Any], *inputs: torch.Tensor, static: tuple[int, ...] = ()
) -> CudagraphRuntime:
    gm = trace_real(fn, *[t.clone() for t in inputs])
    plan = plan_graph(gm, inputs, static, CudagraphOptions(), name="gpu", device="cuda")
    assert plan.captured_segments
    return build_runtime(plan, gm, example_inputs=inputs, pool=new_pool("cuda"))


def _hot(run: CudagraphRuntime) -> Any:
    return run._steps[0][0]._hot  # type: ignore[attr-defined]


def test_same_input_is_read_in_place_and_sees_the_users_writes() -> None:
    x = torch.randn(1024, device="cuda")
    run = compile_cuda(lambda t: t * 2 + 1, x)
    kept = []
    for i in range(6):
        x.fill_(float(i))  # the user writes the input between calls, same address
        kept.append((float(i), run([x])[0]))
    for value, out in kept:
        torch.testing.assert_close(out, torch.full_like(out, value * 2 + 1))
    rec = _hot(run)
    assert rec.stable_idx == [0] and rec.copy_idx == []
    assert isinstance(rec.graph, torch.cuda.CUDAGraph)
    assert rec.replay.__self__ is rec.graph  # the C++ replay, bound: no Python frame
    (seg,) = run.stats().segments
    assert seg.uncaptured_calls == 1 and seg.replays == 5


def test_moving_input_is_copied_after_one_more_recording() -> None:
    x = torch.randn(256, device="cuda")
    run = compile_cuda(lambda t: t.exp() + 1, x)
    for _ in range(3):
        torch.testing.assert_close(run([x])[0], x.exp() + 1)
    for _ in range(6):
        y = torch.randn(256, device="cuda")
        torch.testing.assert_close(run([y])[0], y.exp() + 1)
    torch.testing.assert_close(run([x])[0], x.exp() + 1)
    (seg,) = run.stats().segments
    # x in place, then (once y moved) one recording that copies, used for x too
    assert seg.captured and seg.recordings == 2 and seg.uncaptured_calls == 1
    assert _hot(run).copy_idx == [0] and _hot(run).stable_idx == []


def test_mutated_input_at_a_stable_address_is_updated_by_the_replay() -> None:
    def f(buf: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        buf.mul_(0.5).add_(y)
        return buf * 2

    buf, buf_eager = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
    run = compile_cuda(f, buf, torch.randn(64, device="cuda"))
    for _ in range(6):
        y = torch.randn(64, device="cuda")
        want = f(buf_eager, y)
        torch.testing.assert_close(run([buf, y])[0], want)
        torch.testing.assert_close(buf, buf_eager)


def test_record_calls_reaches_the_runtime_of_a_compiled_function() -> None:
    x = torch.randn(1024, device="cuda")
    compiled = torch.compile(lambda t: t * 2 + 1, backend="loom", options={"cudagraphs": True})
    for _ in range(3):
        compiled(x)
    with CudagraphRuntime.record_calls() as calls:
        want = compiled(x)
    (call,) = calls
    assert isinstance(call.runtime, CudagraphRuntime)
    assert call.inputs[0] is x
    torch.testing.assert_close(call.runtime(list(call.inputs))[0], want)
