"""The only door from ``loom_tracer`` to private torch APIs: fake tensors, the
Python dispatcher, ``make_fx`` and the ``fx.wrap`` table.

Pinned to torch 2.11 and written so that the next version is a small diff: each
name is imported once, under one spelling, and re-exported with a type that the
rest of the package relies on. A test greps the package for ``torch._`` outside
this module.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._dynamo.exc import RestartAnalysis, ShortenTraceback, SkipFrame
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = [
    "CONTROL_FLOW_EXCEPTIONS",
    "FakeTensorMode",
    "fake_mode_of_tensor",
    "is_fx_wrapped",
    "make_fx",
    "new_fake_mode",
    "python_dispatcher",
    "to_fake",
]

#: What Dynamo raises to steer a compilation (restart the analysis, skip the frame):
#: never a refusal of a hook; it must reach Dynamo.
CONTROL_FLOW_EXCEPTIONS: tuple[type[BaseException], ...] = (
    RestartAnalysis,
    SkipFrame,
    ShortenTraceback,
)


def python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher that symbolic-shape tracing needs (as AOTAutograd enables it)."""
    return torch._C._EnablePythonDispatcher()  # type: ignore[no-any-return]


def new_fake_mode() -> FakeTensorMode:
    """A fake mode with static shapes (the tracer guards on exact shapes)."""
    return FakeTensorMode(allow_non_fake_inputs=False)


def fake_mode_of_tensor(t: torch.Tensor) -> FakeTensorMode | None:
    """The fake mode a tensor already belongs to (for hooks traced on AOT's fakes)."""
    if isinstance(t, FakeTensor):
        mode: FakeTensorMode = t.fake_mode
        return mode
    return None


def to_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fake tensor of ``mode`` (itself when it already is one)."""
    if isinstance(t, FakeTensor) and t.fake_mode is mode:
        return t
    return mode.from_tensor(t)


def is_fx_wrapped(fn: Any) -> bool:
    """Whether ``fn`` was registered with ``torch.fx.wrap`` (an opaque leaf for tracing)."""
    from torch.fx import _symbolic_trace

    name = getattr(fn, "__name__", None)
    module_globals = getattr(fn, "__globals__", None)
    if name is None or module_globals is None:
        return False
    table: dict[tuple[int, str], Any] = _symbolic_trace._wrapped_fns_to_patch
    return (id(module_globals), name) in table
