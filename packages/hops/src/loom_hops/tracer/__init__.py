"""The hook tracer: a symbolic interpreter of CPython 3.11/3.12 bytecode for hooks."""

from loom_sidefx import Guard, GuardKind, ReplayPlan

from .api import trace_hook
from .predicates import EqualTo, TensorMeta
from .refusal import HookUnsupported, TraceRefusalKind
from .traced import TracedHook

__all__ = [
    "EqualTo",
    "Guard",
    "GuardKind",
    "HookUnsupported",
    "ReplayPlan",
    "TensorMeta",
    "TraceRefusalKind",
    "TracedHook",
    "trace_hook",
]
