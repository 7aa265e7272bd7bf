"""The hook tracer: a symbolic interpreter of CPython 3.11/3.12 bytecode that
turns a hook (a small Python function with closures and side effects) into an
aten-level FX graph, a replay plan for its Python side effects, guards and a
process-stable fingerprint, or a typed refusal naming the hook's file:line.

    >>> traced = trace_hook(pack, (x,))
    >>> isinstance(traced, TracedHook) and traced.check_guards(x)
    True
"""

from loom_sidefx import Guard, GuardKind, ReplayPlan
from loom_tracer._api import trace_hook
from loom_tracer._predicates import EqualTo, TensorMeta
from loom_tracer._refusal import HookUnsupported, TraceRefusalKind
from loom_tracer._traced import TracedHook

__version__ = "0.1.0"

__all__ = [
    "EqualTo",
    "Guard",
    "GuardKind",
    "HookUnsupported",
    "ReplayPlan",
    "TensorMeta",
    "TraceRefusalKind",
    "TracedHook",
    "__version__",
    "trace_hook",
]
