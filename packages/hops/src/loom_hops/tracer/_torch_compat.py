"""The tracer's only contact with private torch APIs (fake tensors and the fx.wrap table)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


def new_fake_mode() -> FakeTensorMode:
    """A fake mode with static shapes (the tracer guards on exact shapes)."""
    return FakeTensorMode(allow_non_fake_inputs=False)


def fake_mode_of(t: torch.Tensor) -> FakeTensorMode | None:
    """The fake mode a tensor already belongs to (for hooks traced on AOT's fakes)."""
    if isinstance(t, FakeTensor):
        mode: FakeTensorMode = t.fake_mode
        return mode
    return None


def to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, FakeTensor) and t.fake_mode is mode:
        return t
    return mode.from_tensor(t)


def python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher, which symbolic-shape tracing of views needs (AOT enables it too)."""
    from torch._dispatch.python import enable_python_dispatcher

    cm: contextlib.AbstractContextManager[Any] = enable_python_dispatcher()
    return cm


def is_fx_wrapped(fn: Any) -> bool:
    """Whether ``fn`` was registered with ``torch.fx.wrap`` (an opaque leaf for tracing)."""
    from torch.fx import _symbolic_trace

    name = getattr(fn, "__name__", None)
    module_globals = getattr(fn, "__globals__", None)
    if name is None or module_globals is None:
        return False
    table: dict[tuple[int, str], Any] = _symbolic_trace._wrapped_fns_to_patch
    return (id(module_globals), name) in table
