"""Streams and events: operations that only order work, dropped from the trace.

A traced hook becomes part of a graph that runs every op on the current stream,
in program order. That single-stream order satisfies every constraint a stream
or event operation expresses (``wait_stream``, ``wait_event``, ``record_event``,
``Event.record``/``wait``, entering ``torch.cuda.stream(s)``), and
``Tensor.record_stream`` is only a hint to the caching allocator about use on
another stream. So inside a trace these are no-ops: they add no graph node and
no side effect, and each is recorded (``TracedHook.stream_ops``) so that users
of the trace can say the stream ordering was dropped. A stream or event is an
opaque ``OrderingV``; which stream it is does not matter, so a stream read from
pre-existing state is guarded by its type only (a new ``torch.cuda.Stream()``
each step serves the same trace). What reads results into Python or blocks the
host (``synchronize``, ``query``, ``elapsed_time``) stays refused.

Invariant: the CUDA classes and functions go through the same tables as the
``torch.cpu`` ones (dispatch is on the class and function objects), and an
operation that raises in eager (a ``torch.cuda`` call without CUDA, events of a
``torch.Stream`` on the CPU, ``record_stream`` of a CPU tensor) is refused,
never traced.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loom_sidefx import AttrSource, GuardKind, Source

from ._process_constants import describe_call, process_constant_functions
from ._refusal import TraceRefusalKind, refuse
from ._values import (
    ConstV,
    EventV,
    LazyNum,
    MethodV,
    OrderingV,
    StreamContextV,
    StreamV,
    TensorV,
    Value,
)

__all__ = [
    "OrderingContext",
    "call_ordering_function",
    "call_ordering_method",
    "enter_stream_context",
    "ordering_attr",
    "ordering_value",
    "record_stream",
]


class Backend(enum.Enum):
    """What a stream or event class does with the operations the trace drops."""

    #: ``torch.cpu.Stream``/``Event``: Python classes whose operations do nothing.
    SHIM = "shim"
    #: A device's streams and events (CUDA, or ``torch.Stream`` on an accelerator).
    DEVICE = "device"


@dataclass(frozen=True, slots=True)
class OrderingClass:
    """One stream or event class, by its dotted name under ``torch``."""

    name: str
    is_stream: bool
    backend: Backend
    #: The class of what a stream's ``record_event()`` returns (None: it returns None).
    event: str | None = None
    #: The process-constant query that must hold for the hook to create one.
    needs: str | None = None


#: Names this torch lacks are skipped. ``torch.Stream``/``torch.Event`` objects
#: are modelled when their device is not the CPU (whose backend has no events).
ORDERING_CLASSES: tuple[OrderingClass, ...] = (
    OrderingClass("cuda.Stream", True, Backend.DEVICE, "cuda.Event", "cuda.is_available"),
    OrderingClass("cuda.ExternalStream", True, Backend.DEVICE, "cuda.Event"),
    OrderingClass("Stream", True, Backend.DEVICE, "Event"),
    OrderingClass("cpu.Stream", True, Backend.SHIM, None),
    OrderingClass("cuda.Event", False, Backend.DEVICE, None, "cuda.is_available"),
    OrderingClass("Event", False, Backend.DEVICE),
    OrderingClass("cpu.Event", False, Backend.SHIM),
)
#: The current-stream queries: the class of stream they return, and the
#: process-constant query without which they raise.
CURRENT_STREAM_FUNCTIONS: dict[str, tuple[str, str | None]] = {
    "cuda.current_stream": ("cuda.Stream", "cuda.is_available"),
    "cuda.default_stream": ("cuda.Stream", "cuda.is_available"),
    "accelerator.current_stream": ("Stream", "accelerator.is_available"),
    "cpu.current_stream": ("cpu.Stream", None),
}
#: Context managers that select a stream (for CUDA, a stream of the device).
STREAM_CONTEXT_FUNCTIONS: dict[str, Backend | None] = {
    "cuda.stream": Backend.DEVICE,
    "cuda.StreamContext": Backend.DEVICE,
    "cpu.stream": None,
    "cpu.StreamContext": None,
}
#: Calls that block the host until the device is idle.
HOST_SYNC_FUNCTIONS: tuple[str, ...] = (
    "cuda.synchronize",
    "cpu.synchronize",
    "accelerator.synchronize",
)
_ORDERING_METHODS = frozenset({"wait_stream", "wait_event", "record_event", "record", "wait"})
_BLOCKING_METHODS: dict[str, tuple[TraceRefusalKind, str]] = {
    "synchronize": (TraceRefusalKind.UNSUPPORTED_CALL, "blocks the host until its work is done"),
    "query": (TraceRefusalKind.DATA_DEPENDENT_OP, "reads the device's progress into Python"),
    "elapsed_time": (TraceRefusalKind.DATA_DEPENDENT_OP, "reads a timing into Python"),
}
_HINT = (
    "drop it from the hook: the traced graph runs in program order on one stream, "
    "which already orders everything streams and events express"
)


class OrderingContext(Protocol):
    """What stream and event handling needs from the trace (``TraceContext``)."""

    where: str

    def guard(self, source: Source | None, kind: GuardKind, expected: Any) -> None: ...

    def record_process_constant(self, call: str) -> None: ...

    def record_stream_op(self, op: str) -> None: ...


def _resolve(name: str) -> Any:
    obj: Any = torch
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@functools.cache
def _classes() -> dict[type, OrderingClass]:
    found: dict[type, OrderingClass] = {}
    for info in ORDERING_CLASSES:
        cls = _resolve(info.name)
        if isinstance(cls, type):
            found[cls] = info
    return found


@functools.cache
def _functions() -> dict[Any, str]:
    names = (*CURRENT_STREAM_FUNCTIONS, *STREAM_CONTEXT_FUNCTIONS, *HOST_SYNC_FUNCTIONS)
    found: dict[Any, str] = {}
    for name in names:
        fn = _resolve(name)
        if callable(fn):
            found[fn] = name
    return found


def _label(cls: type) -> str:
    return f"torch.{_classes()[cls].name}"


def ordering_value(ctx: OrderingContext, obj: Any, source: Source | None) -> Value | None:
    """A pre-existing stream or event as an ``OrderingV`` guarded by its type only
    (and the device of a ``torch.Stream``/``Event``); None if ``obj`` is neither."""
    info = _classes().get(type(obj))
    if info is None:
        return None
    if type(obj) in (torch.Stream, torch.Event):
        device = obj.device.type
        if device == "cpu":
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE,
                f"a {_label(type(obj))} on the CPU, whose backend has no events (its "
                "operations raise)",
                "use torch.cpu.Stream / torch.cpu.Event, or a stream of a device",
            )
        if source is not None:
            ctx.guard(AttrSource(AttrSource(source, "device"), "type"), GuardKind.EQUALS, device)
    ctx.guard(source, GuardKind.TYPE, type(obj))
    kind = StreamV if info.is_stream else EventV
    return kind(type(obj), obj, source)


def _require(ctx: OrderingContext, query: str | None, what: str) -> None:
    """Raise as eager would when ``what`` needs a backend this process lacks; the
    availability is a process constant, recorded."""
    if query is None:
        return
    fn = _resolve(query)
    if fn not in process_constant_functions():
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"{what}: torch.{query} is missing")
    available = fn()
    ctx.record_process_constant(describe_call(f"torch.{query}", (), available))
    if not available:
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"{what} raises: torch.{query}() is False in this process",
            "the hook runs eagerly (and raises) here",
        )


def _plain(args: list[Value], kwargs: dict[str, Value], what: str) -> None:
    """Device arguments and the like are ignored, but must be plain data."""
    for v in (*args, *kwargs.values()):
        if not isinstance(v, (ConstV, LazyNum)):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE, f"a {v.py_type.__qualname__} passed to {what}"
            )


def call_ordering_function(
    ctx: OrderingContext, fn: Any, args: list[Value], kwargs: dict[str, Value]
) -> Value | None:
    """A call of a current-stream query, a stream context, a host sync or a stream or
    event class; None when ``fn`` is none of them."""
    try:
        info = _classes().get(fn) if isinstance(fn, type) else None
        name = None if info is not None else _functions().get(fn)
    except TypeError:  # unhashable
        return None
    if info is not None:
        what = f"{_label(fn)}()"
        if info.backend is Backend.DEVICE and info.needs is None:
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_CALL,
                f"creating a {_label(fn)} inside the hook (its device is read at run time)",
                "create it outside the hook, or use torch.cuda.Stream / torch.cuda.Event",
            )
        _plain(args, kwargs, what)
        _require(ctx, info.needs, what)
        return (StreamV if info.is_stream else EventV)(fn)
    if name is None:
        return None
    what = f"torch.{name}()"
    if name in HOST_SYNC_FUNCTIONS:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL,
            f"{what} blocks the host until the device is idle: a traced hook has no host wait",
            _HINT,
        )
    if name in CURRENT_STREAM_FUNCTIONS:
        cls_name, needs = CURRENT_STREAM_FUNCTIONS[name]
        _plain(args, kwargs, what)
        _require(ctx, needs, what)
        return StreamV(_resolve(cls_name))
    stream = _bind(what, args, kwargs, ("stream",), 1)["stream"]
    needs_backend = STREAM_CONTEXT_FUNCTIONS[name]
    if not (_is_none(stream) or isinstance(stream, StreamV)) or (
        isinstance(stream, StreamV)
        and needs_backend is not None
        and _classes()[stream.cls].backend is not needs_backend
    ):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE,
            f"a {stream.py_type.__qualname__} passed to {what}",
            "pass a stream of the device (or None)",
        )
    cls = _resolve(name.rsplit(".", 1)[0] + ".StreamContext")
    return StreamContextV(cls, f"with torch.{name}", ConstV(None))


def enter_stream_context(ctx: OrderingContext, manager: Value) -> StreamContextV | None:
    """Entering ``manager`` (a stream context, or a device stream used as one): recorded,
    nothing else; None if ``manager`` is neither."""
    if isinstance(manager, StreamV) and _classes()[manager.cls].backend is Backend.DEVICE:
        manager = StreamContextV(manager.cls, f"with {_label(manager.cls)}", manager)
    if not isinstance(manager, StreamContextV):
        return None
    ctx.record_stream_op(f"{manager.label} at {ctx.where}")
    return manager


def ordering_attr(v: OrderingV, name: str) -> Value:
    """``stream.name``: its ordering and blocking methods (decided when called)."""
    if not hasattr(v.cls, name):
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"AttributeError: {v.cls.__qualname__!r} object has no attribute {name!r}",
        )
    if name in _ORDERING_METHODS or name in _BLOCKING_METHODS:
        return MethodV(v, name, None)
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_ATTRIBUTE,
        f"{_label(v.cls)}.{name}: streams and events are modelled for their ordering only",
        "use wait_stream, wait_event, record_event, record and wait",
    )


def call_ordering_method(
    ctx: OrderingContext, v: OrderingV, name: str, args: list[Value], kwargs: dict[str, Value]
) -> Value:
    """``stream.wait_stream(other)`` and its kind: recorded, no graph op."""
    what = f"{_label(v.cls)}.{name}"
    if name in _BLOCKING_METHODS:
        kind, why = _BLOCKING_METHODS[name]
        raise refuse(kind, f"{what}() {why}: a traced hook cannot wait on the device", _HINT)
    info = _classes()[v.cls]
    result: Value = ConstV(None)
    if isinstance(v, StreamV) and name == "wait_stream":
        _expect(what, _bind(what, args, kwargs, ("stream",), 1)["stream"], StreamV, info)
    elif isinstance(v, StreamV) and name == "wait_event":
        _expect(what, _bind(what, args, kwargs, ("event",), 1)["event"], EventV, info)
    elif isinstance(v, StreamV) and name == "record_event":
        if info.event is None:  # torch.cpu.Stream.record_event() takes nothing, returns None
            _bind(what, args, kwargs, (), 0)
        else:
            event = _bind(what, args, kwargs, ("event",), 0).get("event", ConstV(None))
            if not _is_none(event):
                _expect(what, event, EventV, info)
                result = event
            else:
                result = EventV(_resolve(info.event))
    elif isinstance(v, EventV) and name in ("record", "wait"):
        stream = _bind(what, args, kwargs, ("stream",), 0).get("stream", ConstV(None))
        if not _is_none(stream):
            _expect(what, stream, StreamV, info)
    else:
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"AttributeError: {v.cls.__qualname__!r} object has no attribute {name!r}",
        )
    ctx.record_stream_op(f"{what} at {ctx.where}")
    return result


def record_stream(
    ctx: OrderingContext, t: TensorV, args: list[Value], kwargs: dict[str, Value]
) -> Value:
    """``t.record_stream(s)``: an allocator hint for use on another stream; no graph op."""
    stream = _bind("Tensor.record_stream", args, kwargs, ("s",), 1)["s"]
    if not isinstance(stream, StreamV) or not issubclass(stream.cls, torch.Stream):
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            f"TypeError: Tensor.record_stream() of a {stream.py_type.__qualname__}, not a "
            "torch.Stream",
        )
    if t.fake.device.type == "cpu":
        raise refuse(
            TraceRefusalKind.HOOK_RAISES,
            "NotImplementedError: Tensor.record_stream() of a CPU tensor (no CPU kernel)",
        )
    ctx.record_stream_op(f"Tensor.record_stream at {ctx.where}")
    return ConstV(None)


def _is_none(v: Value) -> bool:
    return isinstance(v, ConstV) and v.value is None


def _expect(what: str, v: Value, kind: type[OrderingV], info: OrderingClass) -> None:
    """An argument must be a stream (or an event); the CPU shims accept anything."""
    if info.backend is Backend.SHIM or isinstance(v, kind):
        return
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_VALUE,
        f"a {v.py_type.__qualname__} passed to {what}, which takes "
        f"{'a stream' if kind is StreamV else 'an event'}",
    )


def _bind(
    what: str, args: list[Value], kwargs: dict[str, Value], params: tuple[str, ...], required: int
) -> dict[str, Value]:
    """The arguments of a call by parameter name, or the ``TypeError`` eager raises."""
    bound = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params or key in bound:
            raise refuse(TraceRefusalKind.HOOK_RAISES, f"TypeError: {what}() got {key!r}")
        bound[key] = value
    if len(args) > len(params) or any(p not in bound for p in params[:required]):
        raise refuse(
            TraceRefusalKind.HOOK_RAISES, f"TypeError: {what}() takes {params} ({len(args)} given)"
        )
    return bound
