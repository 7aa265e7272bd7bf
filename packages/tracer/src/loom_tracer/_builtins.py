"""The builtin functions the tracer can call, each with its implementation.

``BUILTINS`` maps a Python builtin (``len``, ``getattr``, ``min``, ...) to the
function that traces a call of it; ``call_const`` (``_calls.py``) looks a
callable up here. Each implementation registers itself with ``@builtin(fn)``
beside its code, in the module of its family (attribute builtins in
``_attributes.py``, the rest in ``_calls.py``); registering a builtin twice is
an error. A builtin that is in no module's family is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable

from ._context import TraceContext
from ._refusal import TraceRefusalKind, refuse
from ._values import Value

Builtin = Callable[[TraceContext, list[Value], dict[str, Value], int], Value]
BUILTINS: dict[object, Builtin] = {}


def builtin(*fns: object) -> Callable[[Builtin], Builtin]:
    """Register the decorated function as the tracer's implementation of ``fns``."""

    def register(impl: Builtin) -> Builtin:
        for fn in fns:
            if fn in BUILTINS:
                raise ValueError(f"builtin {fn!r} registered twice")
            BUILTINS[fn] = impl
        return impl

    return register


def no_kwargs(name: str, kwargs: dict[str, Value]) -> None:
    """Refuse keyword arguments to builtin ``name``."""
    if kwargs:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"{name}() with keyword arguments")
