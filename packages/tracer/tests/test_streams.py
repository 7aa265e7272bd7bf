"""Streams and events (``_streams.py``): ordering-only operations are dropped from the
trace and recorded with their line, the traced hook matches CPython running it, a new
stream per step serves the same trace, and what blocks the host or reads the device's
progress into Python stays refused.

The CPU machines have no CUDA, so the hooks here use ``torch.cpu``'s stream and event
classes (the same code path: dispatch is on the class and function objects, and the
CUDA ones are in the same tables, checked below on values); the CUDA pair itself is
in ``test_tracer_gpu.py``.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx

from loom_tracer import GuardKind, HookUnsupported, TracedHook, TraceRefusalKind, trace_hook
from loom_tracer._refusal import Refused
from loom_tracer._streams import (
    call_ordering_function,
    call_ordering_method,
    enter_stream_context,
    ordering_attr,
    record_stream,
)
from loom_tracer._torch_compat import new_fake_mode
from loom_tracer._values import ConstV, EventV, StreamContextV, StreamV, TensorV

sys.path.insert(0, str(Path(__file__).parent))
from test_tracer_corpus import assert_same

THRESHOLD = 16


def offload_hooks(side: Any) -> tuple[Any, Any]:
    """The torchtune-style offload pair on ``torch.cpu``'s streams (pageable memory)."""

    def pack(t: torch.Tensor) -> Any:
        if t.numel() < THRESHOLD:
            return (t.device, t)
        cpu = torch.empty(t.size(), dtype=t.dtype, pin_memory=False)
        side.wait_stream(torch.cpu.current_stream())  # <- stream op
        with torch.cpu.stream(side):  # <- stream op
            cpu.copy_(t, non_blocking=True)
        return (t.device, cpu)

    def unpack(packed: Any) -> torch.Tensor:
        device, cpu = packed
        torch.cpu.current_stream().wait_stream(side)  # <- stream op
        return cpu.to(device, non_blocking=True)

    return pack, unpack


def traced(fn: Any, *args: Any) -> TracedHook:
    result = trace_hook(fn, args)
    assert isinstance(result, TracedHook), str(result)
    assert result.check_guards(*args)
    return result


def refused(fn: Any, *args: Any) -> HookUnsupported:
    result = trace_hook(fn, args)
    assert isinstance(result, HookUnsupported), "expected a refusal"
    return result


def marked_lines(fn: Any, marker: str = "# <- stream op") -> list[str]:
    lines, start = inspect.getsourcelines(fn)
    name = os.path.basename(fn.__code__.co_filename)
    return [f"{name}:{start + i}" for i, line in enumerate(lines) if marker in line]


def check_against_cpython(fn: Any, *args: Any) -> TracedHook:
    """Traced and run, the hook gives what CPython gives, and its graph has no trace of
    the stream operations (same nodes as without them)."""
    hook = traced(fn, *args)
    assert_same(fn(*args), hook.run(*args))
    assert not any(
        "stream" in str(n.target) or "event" in str(n.target) for n in hook.graph.graph.nodes
    )
    return hook


# -- the offload pair --------------------------------------------------------------------


def test_stream_offload_pair_traces_and_matches_cpython() -> None:
    pack, unpack = offload_hooks(torch.cpu.Stream())
    x = torch.randn(8, 4)
    traced_pack = check_against_cpython(pack, x)
    stream_lines = marked_lines(pack)
    assert traced_pack.stream_ops == (
        f"torch.cpu.Stream.wait_stream at {stream_lines[0]}",
        f"with torch.cpu.stream at {stream_lines[1]}",
    )
    assert "dropped stream op: torch.cpu.Stream.wait_stream" in traced_pack.describe()
    packed = traced_pack.run(x)
    traced_unpack = check_against_cpython(unpack, packed)
    (line,) = marked_lines(unpack)
    assert traced_unpack.stream_ops == (f"torch.cpu.Stream.wait_stream at {line}",)
    assert torch.equal(traced_unpack.run(packed), x)


def test_small_tensors_take_the_branch_without_streams() -> None:
    pack, _ = offload_hooks(torch.cpu.Stream())
    hook = check_against_cpython(pack, torch.randn(3))
    assert hook.stream_ops == ()


def test_a_new_stream_each_step_serves_the_same_trace() -> None:
    pack, _ = offload_hooks(torch.cpu.Stream())
    x = torch.randn(8, 4)
    hook = traced(pack, x)
    (cell,) = [c for c in pack.__closure__ or () if isinstance(c.cell_contents, torch.cpu.Stream)]
    stream_guards = [g for g in hook.guards if "cell_contents" in g.source.describe()]
    assert [g.kind for g in stream_guards] == [GuardKind.TYPE]  # its type, not its identity
    cell.cell_contents = torch.cpu.Stream()
    assert hook.check_guards(x)
    assert_same(pack(x), hook.run(x))
    cell.cell_contents = None  # the hook would now raise: the type guard fails
    assert not hook.check_guards(x)


def test_a_stream_read_from_an_object_is_guarded_by_type() -> None:
    class Offloader:
        def __init__(self) -> None:
            self.stream = torch.cpu.Stream()

        def pack(self, t: torch.Tensor) -> torch.Tensor:
            self.stream.wait_stream(torch.cpu.current_stream())
            return t * 2

    offloader = Offloader()
    x = torch.randn(3)
    hook = check_against_cpython(offloader.pack, x)
    offloader.stream = torch.cpu.Stream()
    assert hook.check_guards(x)
    offloader.stream = object()
    assert not hook.check_guards(x)


# -- events and contexts ---------------------------------------------------------------


SIDE = torch.cpu.Stream()


def _events(t: torch.Tensor) -> Any:
    done = torch.cpu.Event()
    done.record(SIDE)
    torch.cpu.current_stream().wait_event(done)
    done.wait()
    marker = SIDE.record_event()  # torch.cpu.Stream's returns None
    return (marker, t + 1)


def test_event_record_and_wait_are_dropped_and_cpu_record_event_returns_none() -> None:
    hook = check_against_cpython(_events, torch.randn(3))
    assert [op.split(" at ")[0] for op in hook.stream_ops] == [
        "torch.cpu.Event.record",
        "torch.cpu.Stream.wait_event",
        "torch.cpu.Event.wait",
        "torch.cpu.Stream.record_event",
    ]


def _with_as(t: torch.Tensor) -> Any:
    with torch.cpu.stream(SIDE) as entered, torch.no_grad():
        out = t * 3
    with torch.cpu.StreamContext(None):
        out = out + 1
    return (entered, out)


def test_stream_contexts_enter_and_exit_as_no_ops_beside_grad_modes() -> None:
    x = torch.randn(3, requires_grad=True)
    hook = check_against_cpython(_with_as, x)
    assert [op.split(" at ")[0] for op in hook.stream_ops] == [
        "with torch.cpu.stream",
        "with torch.cpu.StreamContext",
    ]


def _returns_stream(t: torch.Tensor) -> Any:
    return (SIDE, t * 2)


def test_a_preexisting_stream_returned_is_replayed_from_its_source() -> None:
    hook = traced(_returns_stream, torch.randn(2))
    stream, _ = hook.run(torch.randn(2))
    assert stream is SIDE


# -- refusals ----------------------------------------------------------------------------


def _host_sync(t: torch.Tensor) -> torch.Tensor:
    torch.cpu.synchronize()  # <- refused
    return t


def _cuda_sync(t: torch.Tensor) -> torch.Tensor:
    torch.cuda.synchronize()  # <- refused
    return t


def _event_query(t: torch.Tensor) -> torch.Tensor:
    done = torch.cpu.Event()
    if done.query():  # <- refused
        return t
    return t + 1


def _event_sync(t: torch.Tensor) -> torch.Tensor:
    done = torch.cpu.Event()
    done.synchronize()  # <- refused
    return t


def _stream_identity(t: torch.Tensor) -> torch.Tensor:
    with torch.cpu.stream(SIDE):
        if torch.cpu.current_stream() is SIDE:  # <- refused
            return t
    return t + 1


def _event_escapes(t: torch.Tensor) -> Any:
    done = torch.cpu.Event()
    return (done, t)  # <- refused


def _cpu_record_stream(t: torch.Tensor) -> torch.Tensor:
    t.record_stream(SIDE)  # <- refused
    return t


def _cuda_current_stream(t: torch.Tensor) -> torch.Tensor:
    torch.cuda.current_stream().wait_stream(SIDE)  # <- refused
    return t


def _torch_stream_on_cpu(t: torch.Tensor) -> torch.Tensor:
    CPU_STREAM.wait_stream(SIDE)  # <- refused
    return t


CPU_STREAM = torch.Stream(device="cpu")

REFUSALS = [
    (_host_sync, TraceRefusalKind.UNSUPPORTED_CALL, "blocks the host"),
    (_cuda_sync, TraceRefusalKind.UNSUPPORTED_CALL, "torch.cuda.synchronize() blocks the host"),
    (_event_query, TraceRefusalKind.DATA_DEPENDENT_OP, "Event.query() reads the device's progress"),
    (_event_sync, TraceRefusalKind.UNSUPPORTED_CALL, "Event.synchronize() blocks the host"),
    (_stream_identity, TraceRefusalKind.UNSUPPORTED_VALUE, "identity of streams"),
    (_event_escapes, TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, "Event the hook made"),
    # eager raises too: aten::record_stream has no CPU kernel, and a torch.cpu.Stream
    # is not a torch.Stream
    (_cpu_record_stream, TraceRefusalKind.HOOK_RAISES, "record_stream"),
    (_torch_stream_on_cpu, TraceRefusalKind.UNSUPPORTED_VALUE, "no events"),
]
if not torch.cuda.is_available():  # eager raises without CUDA, so the trace does
    REFUSALS.append(
        (_cuda_current_stream, TraceRefusalKind.HOOK_RAISES, "torch.cuda.is_available() is False")
    )


@pytest.mark.parametrize(
    ("hook", "kind", "why"), REFUSALS, ids=[h.__name__.lstrip("_") for h, _, _ in REFUSALS]
)
def test_blocking_or_unmodelled_stream_use_is_refused_with_reason_and_line(
    hook: Any, kind: TraceRefusalKind, why: str
) -> None:
    result = refused(hook, torch.randn(3))
    assert result.kind is kind, str(result)
    assert why in result.explanation, str(result)
    assert [result.where] == marked_lines(hook, "# <- refused")


def test_the_torch_streams_refused_on_the_cpu_raise_in_eager_too() -> None:
    for hook in (_cpu_record_stream, _torch_stream_on_cpu):
        with pytest.raises((RuntimeError, NotImplementedError)):
            hook(torch.randn(3))


# -- the CUDA classes and functions, on values (no CUDA device here) ----------------------


class _Ctx:
    where = "hook.py:1"

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.constants: list[str] = []

    def guard(self, source: Any, kind: GuardKind, expected: Any) -> None:
        pass

    def record_process_constant(self, call: str) -> None:
        self.constants.append(call)

    def record_stream_op(self, op: str) -> None:
        self.ops.append(op)


def test_cuda_stream_and_event_methods_are_the_same_no_ops() -> None:
    ctx = _Ctx()
    side, current = StreamV(torch.cuda.Stream), StreamV(torch.cuda.Stream)
    assert call_ordering_method(ctx, side, "wait_stream", [current], {}).py_type is type(None)
    event = call_ordering_method(ctx, side, "record_event", [], {})
    assert isinstance(event, EventV) and event.cls is torch.cuda.Event
    call_ordering_method(ctx, current, "wait_event", [event], {})
    call_ordering_method(ctx, event, "record", [], {"stream": side})
    call_ordering_method(ctx, event, "wait", [current], {})
    assert ctx.ops == [
        f"torch.cuda.{name} at hook.py:1"
        for name in (
            "Stream.wait_stream",
            "Stream.record_event",
            "Stream.wait_event",
            "Event.record",
            "Event.wait",
        )
    ]
    context = call_ordering_function(ctx, torch.cuda.stream, [side], {})
    assert isinstance(context, StreamContextV) and context.cls is torch.cuda.StreamContext
    assert enter_stream_context(ctx, context) is context
    entered = enter_stream_context(ctx, side)  # `with side:` enters and gives the stream
    assert entered is not None and entered.entered is side
    assert ctx.ops[-2:] == [
        "with torch.cuda.stream at hook.py:1",
        "with torch.cuda.Stream at hook.py:1",
    ]


def test_cuda_blocking_methods_and_other_attributes_are_refused() -> None:
    ctx = _Ctx()
    for v, name, kind in (
        (StreamV(torch.cuda.Stream), "synchronize", TraceRefusalKind.UNSUPPORTED_CALL),
        (StreamV(torch.cuda.Stream), "query", TraceRefusalKind.DATA_DEPENDENT_OP),
        (EventV(torch.cuda.Event), "query", TraceRefusalKind.DATA_DEPENDENT_OP),
        (EventV(torch.cuda.Event), "synchronize", TraceRefusalKind.UNSUPPORTED_CALL),
        (EventV(torch.cuda.Event), "elapsed_time", TraceRefusalKind.DATA_DEPENDENT_OP),
    ):
        ordering_attr(v, name)  # reading the method is fine; calling it is not
        with pytest.raises(Refused) as info:
            call_ordering_method(ctx, v, name, [], {})
        assert info.value.kind is kind
    with pytest.raises(Refused) as info:
        ordering_attr(StreamV(torch.cuda.Stream), "cuda_stream")
    assert info.value.kind is TraceRefusalKind.UNSUPPORTED_ATTRIBUTE
    assert ctx.ops == []


def test_cuda_current_stream_needs_cuda_and_records_that_as_a_process_constant() -> None:
    ctx = _Ctx()
    available = torch.cuda.is_available()
    for fn in (torch.cuda.current_stream, torch.cuda.default_stream):
        if available:
            stream = call_ordering_function(ctx, fn, [], {})
            assert isinstance(stream, StreamV) and stream.cls is torch.cuda.Stream
        else:
            with pytest.raises(Refused) as info:
                call_ordering_function(ctx, fn, [], {})
            assert info.value.kind is TraceRefusalKind.HOOK_RAISES
    assert ctx.constants[-1] == f"torch.cuda.is_available() -> {available}"


def test_record_stream_of_a_device_tensor_is_a_dropped_hint() -> None:
    graph = torch.fx.Graph()
    with new_fake_mode():
        fake = torch.empty(4, device="cuda")
    t = TensorV(graph.placeholder("t"), fake)
    ctx = _Ctx()
    assert isinstance(record_stream(ctx, t, [StreamV(torch.cuda.Stream)], {}), ConstV)
    assert ctx.ops == ["Tensor.record_stream at hook.py:1"]
    with pytest.raises(Refused):  # a torch.cpu.Stream is not a torch.Stream: eager raises
        record_stream(ctx, t, [StreamV(torch.cpu.Stream)], {})
