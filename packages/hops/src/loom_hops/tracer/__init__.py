"""The hook tracer: a symbolic interpreter of CPython 3.11/3.12 bytecode for hooks."""

from .api import trace_hook
from .guards import Guard, GuardKind, TensorMeta
from .refusal import HookUnsupported, TraceRefusal
from .replay import ReplayPlan
from .traced import TracedHook

__all__ = [
    "Guard",
    "GuardKind",
    "HookUnsupported",
    "ReplayPlan",
    "TensorMeta",
    "TraceRefusal",
    "TracedHook",
    "trace_hook",
]
