"""The runtime on the host: HostCapturer replays by overwriting the recorded
outputs in place, as a CUDA graph does, so every rule about addresses,
budgets, held outputs and mutation is checked against eager without a GPU."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _cg_helpers import trace_real

import loom_cudagraph
from loom_cudagraph import (
    CudagraphError,
    CudagraphOptions,
    CudagraphRefusalKind,
    CudagraphRuntime,
    HostCapturer,
    MemoryPool,
    build_runtime,
    mark_non_capturable,
    plan_graph,
    skip_counts,
    unmark_non_capturable,
)

CPU = torch.device("cpu")


@pytest.fixture
def sin_is_host_op() -> Iterator[None]:
    """aten.sin stands in for a host op: segments around it are captured."""
    mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
    yield
    unmark_non_capturable(torch.ops.aten.sin)


def compile_host(
    fn: Callable[..., Any],
    *inputs: torch.Tensor,
    static: tuple[int, ...] = (),
    capturer: HostCapturer | None = None,
    pool: MemoryPool | None = None,
    dynamic: bool = False,
    **options: Any,
) -> tuple[CudagraphRuntime, HostCapturer]:
    gm = trace_real(fn, *inputs)
    plan = plan_graph(gm, inputs, static, CudagraphOptions(**options), name="t", device=CPU)
    if dynamic:
        import dataclasses

        plan = dataclasses.replace(plan, dynamic=True)
    capturer = capturer or HostCapturer()
    return build_runtime(plan, gm, example_inputs=inputs, capturer=capturer, pool=pool), capturer


def call(run: CudagraphRuntime, *args: torch.Tensor) -> list[Any]:
    return run(list(args))


def test_replays_match_eager_and_capture_once() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu() + 1

    w = torch.randn(4, 4)
    run, cap = compile_host(f, torch.randn(2, 4), w, static=(1,))
    # NOTE: all alive at once, so no input lands where the warm-up's was (an input
    # found at its warm-up address is read in place, and records again when it moves)
    xs = [torch.randn(2, 4) for _ in range(6)]
    for x in xs:
        (out,) = call(run, x, w)
        torch.testing.assert_close(out, f(x, w))
    # ``out`` still holds the previous output while the next call runs, so the
    # segment double-buffers: two recordings used in turn, no copies.
    assert cap.captures == 2
    assert cap.replays == 5  # call 1 is the warm-up
    (seg,) = run.stats().segments
    assert seg.captured and seg.recordings == 2 and seg.uncaptured_calls == 1
    assert seg.copied_out == ()


def test_host_op_in_the_middle_keeps_captured_segments_around_it(sin_is_host_op: None) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = x * 2 + y
        b = a.sin()
        return b * y + a

    run, cap = compile_host(f, torch.randn(3), torch.randn(3))
    for _ in range(4):
        x, y = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(call(run, x, y)[0], f(x, y))
    stats = run.stats()
    assert [s.captured for s in stats.segments] == [True, False, True]
    assert cap.captures == 2
    assert stats.segments[1].reasons[0].kind is CudagraphRefusalKind.USER_MARKED


def test_passthrough_input_is_copied_once(sin_is_host_op: None) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = (x + 1).sin()
        return x * a

    run, _ = compile_host(f, torch.randn(3))
    assert run.plan.segments[0].passthrough == ("x_1",)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(call(run, x)[0], f(x))
    last = run._steps[2][0]
    rec = last._tables[None].last  # type: ignore[attr-defined]
    # the passthrough copy is a loom-managed input: used in place; the host
    # op's result is copied
    assert rec.inplace_idx == [0] and rec.copy_idx == [1]


def test_parameter_replaced_every_call_records_again_then_falls_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w + 1

    run, cap = compile_host(f, torch.randn(3), torch.randn(3), static=(1,), max_recording=3)
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for _ in range(8):
            x, w = torch.randn(3), torch.randn(3)  # a new parameter tensor every call
            (out,) = call(run, x, w)
            torch.testing.assert_close(out, f(x, w))
    assert cap.captures == 3
    (seg,) = run.stats().segments
    assert seg.recordings == 3
    warnings = [r.getMessage() for r in caplog.records if "recording_budget" in r.getMessage()]
    assert len(warnings) == 1
    assert "static input w_1 changed its data pointer from 0x" in warnings[0]
    assert skip_counts() == {CudagraphRefusalKind.RECORDING_BUDGET: 1}


def test_parameters_alternating_between_two_addresses_dispatch_by_address() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    w1, w2 = torch.randn(3), torch.randn(3)
    run, cap = compile_host(f, torch.randn(3), w1, static=(1,))
    for i in range(10):
        w = w1 if i % 2 else w2
        x = torch.randn(3)
        (out,) = call(run, x, w)
        torch.testing.assert_close(out, f(x, w))
    assert cap.captures == 2
    assert run.stats().segments[0].uncaptured_calls == 1


class _CountingCapturer(HostCapturer):
    def __init__(self) -> None:
        super().__init__()
        self.pools = 0

    def new_pool_handle(self) -> Any:
        self.pools += 1
        return super().new_pool_handle()


def _reallocate(w: torch.Tensor, blockers: list[torch.Tensor]) -> None:
    """What FSDP2 does to an unsharded parameter between uses: its storage freed and
    allocated again (the same storage, a new address), then refilled."""
    storage = w.untyped_storage()
    storage.resize_(0)
    blockers.append(torch.empty(3))  # keeps the freed block: the next one moves
    storage.resize_(3 * w.element_size())
    w.copy_(torch.randn(3))


def test_parameter_moved_with_its_storage_records_again_into_the_replaced_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FSDP2 frees an unsharded parameter's memory after use and allocates it again
    before the next use: the same storage, a new address every step. Each new
    recording replaces the last one in its pool rather than taking a pool of its
    own (on 2xH100 every step's recording held a pool: memory grew per step); once
    two recordings in a row were each replaced before a second replay, the segment
    stops recording, releases them and runs uncaptured, with the reason reported."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w + 1

    w = torch.randn(3)
    cap = _CountingCapturer()
    run, _ = compile_host(f, torch.randn(3), w, static=(1,), capturer=cap, max_recording=8)
    blockers: list[torch.Tensor] = []
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for _ in range(7):
            _reallocate(w, blockers)
            x = torch.randn(3)
            (out,) = call(run, x, w)
            torch.testing.assert_close(out, f(x, w))
    # a warm-up, two recordings (the second replacing the first in its pool), then
    # the shape is declined: every later call runs uncaptured and records nothing
    assert cap.captures == 2
    assert cap.pools == 1
    (seg,) = run.stats().segments
    assert seg.uncaptured_calls == 5
    assert skip_counts() == {CudagraphRefusalKind.INPUT_REALLOCATED: 1}
    (warning,) = [r.getMessage() for r in caplog.records if "input_reallocated" in r.getMessage()]
    assert "static inputs w_1 got new memory on each of the last 3 calls" in warning
    assert "capture_step" in warning


def test_parameter_moved_once_then_kept_still_replays() -> None:
    """A storage re-allocated once (a lazy initialization) is not "every call": the
    recording made for the new address replays from then on."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w - 2

    w = torch.randn(3)
    run, cap = compile_host(f, torch.randn(3), w, static=(1,))
    blockers: list[torch.Tensor] = []
    for i in range(8):
        if i == 2:
            _reallocate(w, blockers)
        x = torch.randn(3)
        (out,) = call(run, x, w)
        torch.testing.assert_close(out, f(x, w))
    (seg,) = run.stats().segments
    assert seg.captured and seg.uncaptured_calls == 1
    assert cap.captures == 2 and cap.replays == 7  # each recording's own replay, then 5


def test_parameter_moved_every_other_call_is_not_declined() -> None:
    """Each recording replays once more before its input moves: no recording is wasted
    outright, so the shape keeps recording (within its budget) and is never declined."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x + w

    w = torch.randn(3)
    run, _ = compile_host(f, torch.randn(3), w, static=(1,), max_recording=8)
    blockers: list[torch.Tensor] = []
    for i in range(10):
        if i % 2:
            _reallocate(w, blockers)
        x = torch.randn(3)
        (out,) = call(run, x, w)
        torch.testing.assert_close(out, f(x, w))
    assert CudagraphRefusalKind.INPUT_REALLOCATED not in skip_counts()
    (seg,) = run.stats().segments
    assert seg.replays > seg.recordings  # every recording replayed again at least once


def test_outputs_kept_across_many_calls_stay_correct() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2

    run, _ = compile_host(f, torch.randn(3))
    kept, expected = [], []
    for _ in range(12):
        x = torch.randn(3)
        kept.append(call(run, x))
        expected.append(f(x))
    for got, want in zip(kept, expected, strict=True):
        torch.testing.assert_close(got, list(want))


def test_no_copy_out_while_nothing_is_held() -> None:
    run, cap = compile_host(lambda x: x.exp() + 1, torch.randn(3))
    for _ in range(10):
        x = torch.randn(3)
        torch.testing.assert_close(call(run, x)[0], x.exp() + 1)
    (seg,) = run.stats().segments
    assert seg.copied_out == () and seg.recordings == 1 and cap.replays == 9


def test_outputs_held_by_both_buffers_are_copied_out_from_then_on() -> None:
    run, cap = compile_host(lambda x: (x.exp(), x + 1), torch.randn(3))
    kept = []
    for _ in range(10):
        x = torch.randn(3)
        outs = call(run, x)
        kept.append((x, outs[0]))  # every first output is kept; the second is dropped
        torch.testing.assert_close(outs[1], x + 1)
        del outs
    for x, exp in kept:
        torch.testing.assert_close(exp, x.exp())
    (seg,) = run.stats().segments
    assert seg.copied_out == (0,)
    assert seg.recordings == 3  # two buffers retired while held, then one that copies out
    assert cap.replays == 9


def test_view_of_an_output_counts_as_held() -> None:
    run, _ = compile_host(lambda x: x * 3, torch.randn(4))
    views, expected = [], []
    for _ in range(5):
        x = torch.randn(4)
        views.append(call(run, x)[0][1:])
        expected.append((x * 3)[1:])
    for v, e in zip(views, expected, strict=True):
        torch.testing.assert_close(v, e)


def test_mutated_user_input_is_copied_back() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(y)
        return x * 2

    run, _ = compile_host(f, torch.randn(3), torch.randn(3))
    for _ in range(5):
        x, y = torch.randn(3), torch.randn(3)
        x_eager = x.clone()
        want = f(x_eager, y)
        (out,) = call(run, x, y)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x, x_eager)


def test_mutated_parameter_is_updated_in_place() -> None:
    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.mul_(0.5).add_(x)
        return buf + 0

    buf = torch.zeros(3)
    buf_eager = torch.zeros(3)
    run, _ = compile_host(f, torch.randn(3), torch.zeros(3), static=(1,))
    for _ in range(6):
        x = torch.randn(3)
        want = f(x, buf_eager)
        (out,) = call(run, x, buf)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(buf, buf_eager)


def test_one_recording_per_shape_then_uncaptured_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run, cap = compile_host(lambda x: x + 1, torch.randn(2), dynamic=True, max_shapes=2)
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for n in (2, 3, 2, 3, 4, 4, 5, 2, 3):
            x = torch.randn(n)
            torch.testing.assert_close(call(run, x)[0], x + 1)
    assert cap.captures == 2
    (seg,) = run.stats().segments
    assert seg.shapes == 2
    assert sum("dynamic_shape_budget" in r.getMessage() for r in caplog.records) == 1


def test_two_functions_sharing_a_pool_interleave_correctly() -> None:
    pool = MemoryPool(object())
    cap = HostCapturer()
    f_run, _ = compile_host(lambda x: x * 2, torch.randn(3), capturer=cap, pool=pool)
    g_run, _ = compile_host(lambda x: x - 1, torch.randn(3), capturer=cap, pool=pool)
    kept = []
    for _ in range(6):
        x = torch.randn(3)
        a = call(f_run, x)[0]
        b = call(g_run, a)[0]
        kept.append((x, a, b))
    for x, a, b in kept:
        torch.testing.assert_close(a, x * 2)
        torch.testing.assert_close(b, x * 2 - 1)


class _FailingCapturer(HostCapturer):
    def capture(self, fn: Any, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_runs_uncaptured_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    run, _ = compile_host(lambda x: x + 1, torch.randn(3), capturer=_FailingCapturer())
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for _ in range(4):
            x = torch.randn(3)
            torch.testing.assert_close(call(run, x)[0], x + 1)
    (seg,) = run.stats().segments
    assert not seg.captured and seg.reasons[0].kind is CudagraphRefusalKind.CAPTURE_FAILED
    assert "operation not permitted" in seg.reasons[0].explanation
    assert skip_counts() == {CudagraphRefusalKind.CAPTURE_FAILED: 1}


def test_or_error_raises_at_runtime_for_an_exhausted_budget() -> None:
    run, _ = compile_host(
        lambda x, w: x * w,
        torch.randn(3),
        torch.randn(3),
        static=(1,),
        max_recording=1,
        or_error=True,
    )
    call(run, torch.randn(3), torch.randn(3))  # warm-up
    w = torch.randn(3)
    call(run, torch.randn(3), w)  # records
    with pytest.raises(CudagraphError, match=r"recording_budget.*w_1"):
        call(run, torch.randn(3), torch.randn(3))


def test_or_error_raises_at_build_naming_op_reason_and_line() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).sin()

    gm = trace_real(f, torch.randn(3))
    sin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default)
    sin.meta["stack_trace"] = '  File "/user/model.py", line 7, in forward\n    return h.sin()\n'
    mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
    try:
        plan = plan_graph(gm, [torch.randn(3)], (), CudagraphOptions(or_error=True), device=CPU)
    finally:
        unmark_non_capturable(torch.ops.aten.sin)
    with pytest.raises(CudagraphError) as info:
        build_runtime(plan, gm, capturer=HostCapturer())
    message = str(info.value)
    assert "aten.sin.default" in message
    assert "[user_marked]" in message
    assert "at /user/model.py:7 in forward" in message


def test_plan_skips_are_logged_once_and_counted(
    sin_is_host_op: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        compile_host(lambda x: (x + 1).sin() + 1, torch.randn(3))
        compile_host(lambda x: (x + 1).sin() + 1, torch.randn(3))
    assert skip_counts() == {CudagraphRefusalKind.USER_MARKED: 2}
    assert sum("user_marked" in r.getMessage() for r in caplog.records) == 1


def test_inputs_are_freed_from_the_boxed_list() -> None:
    run, _ = compile_host(lambda x: x + 1, torch.randn(3))
    args = [torch.randn(3)]
    run(args)
    assert args == []


def test_an_input_read_in_place_lives_until_the_first_replay_has_read_it() -> None:
    # A non-dense view is read in place, and no loom pool owns its memory; the
    # call's input list holds it alone, so the code frees it during the capture.
    # The first replay comes right after and reads its address: on CUDA, memory the
    # caching allocator may have given back to the driver (``empty_cache`` runs
    # around each capture), so the record call must keep such inputs alive until
    # that replay is done. HostCapturer refuses a first replay over a freed input.
    run, cap = compile_host(lambda x: x * 2, torch.randn(4, 6)[:, ::2])
    for _ in range(3):
        base = torch.randn(4, 6)
        expected = base[:, ::2] * 2
        args = [base[:, ::2]]
        del base
        (out,) = run(args)
        torch.testing.assert_close(out, expected)
        del out
    assert cap.captures >= 1 and cap.replays >= 1


def test_host_capturer_refuses_a_first_replay_that_reads_a_freed_input() -> None:
    # The stand-in's own check, which the test above relies on: it must fire.
    cap = HostCapturer()
    base = torch.randn(4, 6)
    args: list[Any] = [base[:, ::2]]
    del base

    def fn(inputs: list[Any]) -> list[Any]:
        (x,) = inputs
        inputs.clear()
        return [x * 2]

    graph, _outs = cap.capture(fn, args, object())
    with pytest.raises(RuntimeError, match=r"first replay reads inputs \[0\]"):
        cap.replay(graph)


def test_host_capturer_takes_inputs_whose_storage_holds_no_memory() -> None:
    # FSDP-style: the weight's storage is freed between uses and the graph allocates
    # it (resize), fills it and frees it again. Nothing of it is saved or restored
    # around the capture (it had no memory, then none again); the host stand-in
    # crashed cloning it before.
    cap = HostCapturer()
    w = torch.empty(4, 4)
    w.untyped_storage().resize_(0)
    shard = torch.randn(4, 4)

    def fn(inputs: list[Any]) -> list[Any]:
        weight, x = inputs
        inputs.clear()
        weight.untyped_storage().resize_(weight.numel() * weight.element_size())
        with torch.no_grad():
            weight.copy_(shard)
        out = x @ weight
        weight.untyped_storage().resize_(0)
        return [out]

    x = torch.randn(2, 4)
    graph, (out,) = cap.capture(fn, [w, x], object())
    torch.testing.assert_close(out, x @ shard)
    assert w.untyped_storage().nbytes() == 0
    cap.replay(graph)
    assert w.untyped_storage().nbytes() == 0


class _Rec:
    def __init__(self) -> None:
        self.order = -1
        self.watch: list[Any] = []
        self.checks: tuple[int, list[tuple[int, int]]] = (-1, [])
        self.retired_with: list[Any] | None = None

    def retire(self, held: list[Any]) -> None:
        self.retired_with = held


def test_pool_retires_a_later_recording_whose_outputs_are_held() -> None:
    from loom_cudagraph._pool import Watch

    counts = {1: 1, 2: 1}
    pool = MemoryPool(object(), use_count=counts.__getitem__)
    first, second = _Rec(), _Rec()
    first.watch = [Watch(1, 1, (0,), ())]
    second.watch = [Watch(2, 1, (0,), ())]
    pool.add(first)
    pool.add(second)
    assert not pool.blocked(first) and not pool.blocked(second)
    counts[2] = 2  # someone holds the second recording's output
    assert pool.blocked(first) and pool.blocked(second)
    pool.release(first)
    assert second.retired_with is not None and first.retired_with == []
    assert pool.recordings == []
    third = _Rec()
    pool.add(third)
    assert pool.blocked(third) is False  # captured after the orphan: cannot overwrite it
    older = _Rec()
    older.order = 0
    assert pool.blocked(older)  # captured before it: could
    counts[2] = 1  # released: the orphan is dropped
    assert not pool.blocked(older) and pool.orphans == []


def test_several_mutated_user_inputs_are_copied_in_and_back_together() -> None:
    def f(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x.add_(z)
        y.mul_(2)
        return x * y + z

    run, cap = compile_host(f, torch.randn(3), torch.randn(3), torch.randn(3))
    for _ in range(5):
        x, y, z = torch.randn(3), torch.randn(3), torch.randn(3)
        x_eager, y_eager = x.clone(), y.clone()
        want = f(x_eager, y_eager, z)
        (out,) = call(run, x, y, z)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x, x_eager)
        torch.testing.assert_close(y, y_eager)
    rec = run._steps[0][0]._hot  # type: ignore[attr-defined]
    assert rec.copy_idx == [0, 1, 2] and rec.copyback_idx == [0, 1]
    assert cap.replays == 4


class _FailsOnSecondCapture(HostCapturer):
    def capture(self, fn: Any, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        if self.captures:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, inputs, pool)


def test_failed_re_recording_turns_the_segment_off_for_every_address() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    w1, w2 = torch.randn(3), torch.randn(3)
    run, cap = compile_host(f, torch.randn(3), w1, static=(1,), capturer=_FailsOnSecondCapture())
    for w in (w1, w1, w1, w2, w1, w1):  # warm-up, record, replay, re-record fails, then w1
        x = torch.randn(3)
        torch.testing.assert_close(call(run, x, w)[0], f(x, w))
    (seg,) = run.stats().segments
    assert not seg.captured and seg.reasons[0].kind is CudagraphRefusalKind.CAPTURE_FAILED
    # the first recording is not replayed once the segment is off
    assert cap.replays == 2 and seg.uncaptured_calls == 4


def test_record_calls_gives_the_runtime_and_the_inputs_its_caller_passed() -> None:
    w = torch.randn(3)
    run, cap = compile_host(lambda x, w: x * w + 1, torch.randn(3), w, static=(1,))
    x = torch.randn(3)
    call(run, x, w)  # warm-up
    with CudagraphRuntime.record_calls() as calls:
        call(run, x, w)
    call(run, x, w)  # not recorded
    (rec,) = calls
    assert rec.runtime is run and rec.graph == "t"
    assert rec.inputs[0] is x and rec.inputs[1] is w
    replays = cap.replays
    (out,) = rec.runtime(list(rec.inputs))
    torch.testing.assert_close(out, x * w + 1)
    assert cap.replays == replays + 1


def test_input_that_keeps_its_address_is_read_in_place_without_a_copy() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + y

    x = torch.randn(3)
    x_eager = x.clone()
    run, cap = compile_host(f, x.clone(), torch.randn(3))  # tracing runs f
    for _ in range(6):
        y = torch.randn(3)  # a fresh tensor every call: copied
        x.add_(1)  # changed by the user between calls, at the same address
        x_eager.add_(1)
        want = f(x_eager, y)
        torch.testing.assert_close(call(run, x, y)[0], want)
        torch.testing.assert_close(x, x_eager)  # mutated in place by the replay itself
    rec = run._steps[0][0]._hot  # type: ignore[attr-defined]
    assert rec.inplace_idx == [0] and rec.stable_idx == [0] and rec.copy_idx == [1]
    assert rec.copyback_idx == []
    assert cap.captures == 1 and cap.replays == 5


def test_a_fresh_tensor_at_the_warm_up_inputs_address_is_copied_not_read_in_place() -> None:
    # A backward's incoming gradient is a new tensor every step that the allocator
    # often places where the warm-up's was: the address alone must not make it
    # "stable" (read in place), or the next step's gradient elsewhere records again.
    from loom_cudagraph._torch_compat import non_owning_alias

    x = torch.randn(3)
    run, cap = compile_host(lambda t: t * 3, x)
    call(run, x)  # the warm-up
    same_place = non_owning_alias(x)  # another storage over the warm-up's memory
    assert same_place.data_ptr() == x.data_ptr()
    torch.testing.assert_close(call(run, same_place)[0], x * 3)
    rec = run._steps[0][0]._hot  # type: ignore[attr-defined]
    assert rec.copy_idx == [0] and rec.stable_idx == []
    for _ in range(3):  # fresh tensors anywhere replay the one recording
        y = torch.randn(3)
        torch.testing.assert_close(call(run, y)[0], y * 3)
    assert cap.captures == 1


def test_stable_input_that_moves_is_copied_from_then_on_without_spending_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = torch.randn(3)
    run, cap = compile_host(lambda t: t * 3, x, max_recording=1)
    with caplog.at_level(logging.WARNING, logger="torchloom.cudagraph"):
        for _ in range(3):  # warm-up, record (x in place), replay
            torch.testing.assert_close(call(run, x)[0], x * 3)
        kept = []
        for _ in range(5):  # a new tensor every call
            kept.append(torch.randn(3))
            torch.testing.assert_close(call(run, kept[-1])[0], kept[-1] * 3)
        torch.testing.assert_close(call(run, x)[0], x * 3)  # the first recording again
    (seg,) = run.stats().segments
    assert seg.captured and seg.uncaptured_calls == 1 and seg.recordings == 2
    assert cap.captures == 2 and cap.replays == 8
    copying = run._steps[0][0]._tables[None].recordings[1]  # type: ignore[attr-defined]
    assert copying.copy_idx == [0] and copying.stable_idx == []
    assert not [r for r in caplog.records if "recording_budget" in r.getMessage()]


def test_suspended_segments_run_their_code_without_warm_up_or_recording() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    run, cap = compile_host(f, torch.randn(3))
    with loom_cudagraph.suspended():
        for _ in range(3):
            x = torch.randn(3)
            (out,) = call(run, x)
            torch.testing.assert_close(out, f(x))
    assert cap.captures == 0 and cap.replays == 0
    (seg,) = run.stats().segments
    assert seg.recordings == 0 and seg.shapes == 0
    for _ in range(3):  # after the block: warm-up, record, replay as usual
        call(run, torch.randn(3))
    assert cap.captures == 1 and cap.replays == 2


# --- outputs' memory goes back to the pool when the originals die --------------------------


def _segment(run: CudagraphRuntime) -> Any:
    return run._steps[0][0]  # type: ignore[attr-defined]


def _shared_pair() -> tuple[CudagraphRuntime, CudagraphRuntime, HostCapturer, MemoryPool]:
    """A forward and a "backward" sharing one pool: the second consumes the first's output."""
    pool = MemoryPool(object())
    cap = HostCapturer()
    fw, _ = compile_host(lambda x: (x * 2, x * 3), torch.randn(3), capturer=cap, pool=pool)
    bw, _ = compile_host(lambda a: a + 1, torch.randn(3), capturer=cap, pool=pool)
    return fw, bw, cap, pool


def _step(fw: CudagraphRuntime, bw: CudagraphRuntime, x: torch.Tensor) -> tuple[Any, Any]:
    a, c = fw([x])
    args = [a]
    del a  # as AOTAutograd hands saved activations over: the list holds them alone
    (b,) = bw(args)
    return b, c


def test_recording_call_hands_out_the_capture_outputs_and_keeps_twins() -> None:
    run, _ = compile_host(lambda x: x * 2, torch.randn(3))
    x = torch.randn(3)
    call(run, x)  # warm-up
    (first,) = call(run, x)
    rec = _segment(run)._hot
    (twin,) = rec.outputs
    assert first.data_ptr() == twin.data_ptr()
    # not the recording's own storage: when the caller drops it, its memory is free
    assert first.untyped_storage()._cdata != twin.untyped_storage()._cdata
    (w,) = rec.watch
    assert not w.owned and w.original_alive()
    assert rec.pool.blocked(rec)  # the original is held: a replay would overwrite it
    del first
    assert not w.original_alive() and not rec.pool.blocked(rec)
    (second,) = call(run, x)
    assert second.untyped_storage()._cdata == twin.untyped_storage()._cdata
    torch.testing.assert_close(second, x * 2)


def test_a_consumer_recorded_after_its_input_died_may_reuse_that_memory() -> None:
    fw, bw, cap, pool = _shared_pair()
    for _ in range(5):
        x = torch.randn(3)
        b, c = _step(fw, bw, x)
        torch.testing.assert_close(b, x * 2 + 1)
        torch.testing.assert_close(c, x * 3)
        del b, c
    assert cap.captures == 2  # one forward, one backward recording: replayed since
    rec = _segment(bw)._hot
    assert rec.pool is pool
    # the forward's first output died while the backward was captured (it was
    # consumed: position 0 of the backward's inputs); the second was held then
    consumed = {w.positions: positions for w, positions in rec.reuse}
    assert consumed == {(0,): (0,)}


def test_an_earlier_output_held_again_keeps_the_reusing_recording_from_replaying() -> None:
    fw, bw, cap, pool = _shared_pair()
    for _ in range(3):
        _step(fw, bw, torch.randn(3))
    reusing = _segment(bw)._hot
    assert reusing.reuse and cap.captures == 2
    x = torch.randn(3)
    a, c = fw([x])
    held = a  # someone keeps the forward's output past the backward this time
    assert not pool.reuse_free(reusing.reuse, [a])
    (b,) = bw([a])
    torch.testing.assert_close(b, x * 2 + 1)
    torch.testing.assert_close(held, x * 2)
    # a new recording in a pool of its own; the reusing one is kept for later steps
    assert cap.captures == 3
    fresh = _segment(bw)._hot
    assert fresh is not reusing and fresh.pool is not pool and fresh.reuse == []
    del a, held, c, b
    x = torch.randn(3)
    b, _ = _step(fw, bw, x)
    torch.testing.assert_close(b, x * 2 + 1)
    assert cap.captures == 3


def test_held_dropped_output_keeps_the_reusing_recording_from_replaying() -> None:
    fw, bw, cap, _ = _shared_pair()
    for _ in range(3):
        a, c = fw([torch.randn(3)])
        del c  # the forward's second output is dropped before the backward ...
        args = [a]
        del a
        bw(args)
    reusing = _segment(bw)._hot
    assert [w.positions for w, _ in reusing.reuse] == [(0,), (1,)]
    x = torch.randn(3)
    b, c = _step(fw, bw, x)  # ... and now it is held across the backward
    torch.testing.assert_close(b, x * 2 + 1)
    torch.testing.assert_close(c, x * 3)
    assert cap.captures == 3 and _segment(bw)._hot is not reusing


def test_outputs_outlive_their_runtime_with_their_memory() -> None:
    import gc

    from loom_cudagraph import _pool

    run, _ = compile_host(lambda x: x * 2, torch.randn(64))
    x = torch.randn(64)
    for _ in range(4):
        (out,) = call(run, x)
    twins = {
        r.outputs[0].untyped_storage()._cdata
        for t in _segment(run)._tables.values()
        for r in t.recordings
    }
    assert out.untyped_storage()._cdata in twins  # an alias of a recording's memory
    del run
    gc.collect()
    assert _pool._adopted  # the graph that owns the memory is kept for ``out``
    garbage = [torch.full((64,), 7.0) for _ in range(50)]  # reuse any freed memory
    torch.testing.assert_close(out, x * 2)
    del out, garbage
    _pool.prune_adopted()
    assert not _pool._adopted


def test_release_drops_the_graphs_and_the_next_calls_record_again() -> None:
    import gc
    import weakref

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu() + 1

    w = torch.randn(4, 4)
    run, cap = compile_host(f, torch.randn(2, 4), w, static=(1,))
    x = torch.randn(2, 4)
    for _ in range(3):  # warm-up, record, replay
        call(run, x, w)
    assert cap.captures == 1
    (seg,) = (s for s in run._stats if isinstance(s, loom_cudagraph._segment.CapturedSegment))
    (rec,) = (r for t in seg._tables.values() for r in t.recordings)
    graph = weakref.ref(rec.graph)
    outputs = [weakref.ref(o) for o in rec.outputs]
    del rec

    loom_cudagraph.release_graphs()
    gc.collect()
    # nothing of the recording lives on: its graph and static outputs (the pool's memory) are gone
    assert graph() is None
    assert all(o() is None for o in outputs)
    # still callable: warms up and records again, right results throughout
    for _ in range(3):
        torch.testing.assert_close(call(run, x, w)[0], f(x, w))
    assert cap.captures == 2
    (stats,) = run.stats().segments
    assert stats.recordings == 2 and stats.uncaptured_calls == 2
