"""Recording a finished trace's return value and side effects in its ``loom_sidefx`` log.

While tracing, every mutation of Python state already went into the trace's
``SideEffects`` log, in program order, with the tracer's own values held as
``Staged`` (see ``TraceContext.log``). ``PlanRecorder`` gives the staged values
that reach the replay plan a recorded value when the log is built:
constants as they are, pre-existing objects and numbers as ``Original``s of
their source (``Computed`` for arithmetic on them, so ``count += 1`` needs no
guard), tensors as graph outputs (``TensorSlot``; user outputs are allocated
first, because the return value is resolved first), containers the hook
created as their ``Ref`` in the log (tuples as plain tuples). Anything that
cannot be rebuilt after the graph (functions or objects created in the hook,
symbolic sizes) is refused here.
"""

from __future__ import annotations

import torch.fx

from loom_cells import CellRefused
from loom_sidefx import (
    ObjectSource,
    Original,
    Ref,
    ReplayPlan,
    SideEffectRefused,
    SideEffects,
    Staged,
    TensorSlot,
    is_constant,
)
from loom_sidefx import Value as Recorded

from ._kinds import is_symbolic
from ._predicates import stable_repr
from ._refusal import Refused, TraceRefusalKind, refuse
from ._values import (
    ConstV,
    DictV,
    FunctionV,
    LazyNum,
    ListV,
    ObjectV,
    OrderingV,
    SetV,
    SymV,
    TensorV,
    TupleV,
    Value,
)


def constant_value(value: object) -> Recorded:
    """A trace-time constant as a recorded value (non-builtin ones held by identity)."""
    if is_constant(value):
        return value
    return Original(ObjectSource(value, f"const:{stable_repr(value)}"), value)


class PlanRecorder:
    """Converts values into recorded values, allocating graph slots and new objects."""

    def __init__(self, side_effects: SideEffects) -> None:
        self.se = side_effects
        self.slots: list[torch.fx.Node] = []
        self.slot_of: dict[torch.fx.Node, TensorSlot] = {}

    def value(self, v: Value) -> Recorded:
        if isinstance(v, LazyNum):
            return v.ref
        if isinstance(v, SymV) or (isinstance(v, ConstV) and is_symbolic(v.value)):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
                "a symbolic size would be stored or returned as a Python value",
                "return or store tensors, or trace with static shapes",
            )
        if isinstance(v, ConstV):
            return constant_value(v.value)
        if v.source is not None:
            return Original(v.source, _live(v))
        if isinstance(v, TensorV):
            if v.node not in self.slot_of:
                self.slot_of[v.node] = self.se.new_tensor_slot()
                self.slots.append(v.node)
            return self.slot_of[v.node]
        if isinstance(v, TupleV):
            if v.py_type is not tuple:
                raise refuse(
                    TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
                    f"a {v.py_type.__qualname__} created inside the hook escapes it",
                )
            return tuple(self.value(x) for x in v.items)
        if isinstance(v, (ListV, DictV, SetV)):
            return self._new(v)
        if isinstance(v, OrderingV):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
                f"a {v.py_type.__qualname__} the hook made or asked for escapes it: stream "
                "operations are dropped from the trace, so there is no object to replay",
                "keep streams and events outside the hook's result and state",
            )
        if isinstance(v, FunctionV):
            new_cells = [c.name for c in v.closure if c.is_new]
            captured = (
                f", with the cells it closes over ({', '.join(new_cells)})" if new_cells else ""
            )
            raise refuse(
                TraceRefusalKind.ESCAPING_FUNCTION,
                f"function {v.name!r} created inside the hook escapes it (returned or stored)"
                f"{captured}",
                "define the function at module level or outside the hook",
            )
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
            f"a {v.py_type.__name__} created inside the hook escapes it",
        )

    def _new(self, v: ListV | DictV | SetV) -> Ref:
        if v.py_type not in (list, dict, set):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
                f"a {v.py_type.__qualname__} created inside the hook escapes it",
            )
        return v.ref

    def resolve(self, v: Value) -> Recorded:
        """``SideEffects.build``'s ``resolve``: a staged tracer value, at the op's line."""
        try:
            return self.value(v)
        except Refused as exc:
            exc.where = exc.where or self.se.where or None
            raise

    def finish(self, result: Value) -> tuple[ReplayPlan, int]:
        """The replay plan of ``result`` and the log, and the number of user outputs."""
        try:
            returned = self.se.resolve((Staged(result),), self.resolve)
            num_user = len(self.slots)
            return self.se.build(results=returned, resolve=self.resolve), num_user
        except (SideEffectRefused, CellRefused) as exc:
            u = exc.reason
            refused = refuse(TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, u.explanation, u.hint)
            refused.where = u.where or None
            raise refused from None


def _live(v: Value) -> object:
    """The trace-time object behind a sourced value (for ``loom_sidefx.concrete``)."""
    if isinstance(v, (ConstV, LazyNum)):
        return v.value
    if isinstance(v, (ObjectV, OrderingV)):
        return v.obj
    if isinstance(v, FunctionV):
        return v.fn
    return None
