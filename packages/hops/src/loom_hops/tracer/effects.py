"""Recording a finished trace's return value and side effects in a ``loom_sidefx`` log.

``PlanRecorder`` gives each tracer ``Value`` a ``loom_sidefx`` value:
constants as they are, pre-existing objects and numbers as ``Original``s of
their source (``Computed`` for arithmetic on them, so ``count += 1`` needs no
guard), tensors as graph outputs (``TensorSlot``; user outputs are allocated
first, because the return value is recorded first), containers the hook
created with their final contents (``SideEffects.track_new``; tuples as plain
tuples). Buffered effects are then replayed into the log in program order
(``SideEffects.list_append``, ``dict_setitem``, ...; writes to pre-existing
closure cells, which ``loom_cells.CellModel`` held as staged tracer values
while tracing, through ``CellModel.store``), and ``SideEffects.build``
makes the ``ReplayPlan``. Anything that cannot be rebuilt after the graph
(functions or objects created in the hook, symbolic sizes) is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx

from loom_cells import Cell, CellRefused
from loom_sidefx import (
    ObjectSource,
    ObjKind,
    OpKind,
    Original,
    Ref,
    ReplayPlan,
    SideEffectRefused,
    Source,
    TensorSlot,
    is_constant,
)
from loom_sidefx import Value as Recorded

from .predicates import stable_repr
from .refusal import Refused, TraceRefusal, refuse
from .values import (
    ConstV,
    DictV,
    FunctionV,
    LazyNum,
    ListV,
    ObjectV,
    SetV,
    SymV,
    TensorV,
    TupleV,
    Value,
)

if TYPE_CHECKING:
    from .context import TraceContext


@dataclass
class PendingEffect:
    """One mutation seen while tracing, recorded into the log when the trace ends.

    ``op`` is the ``loom_sidefx`` operation; a store to a pre-existing cell
    (``STORE_CELL``) names its ``loom_cells`` ``cell``, and a global store
    (``DICT_SETITEM`` / ``DICT_DELITEM`` on the globals dict) its pre-existing
    ``root`` object and ``root_source``, instead of a target.
    """

    op: OpKind
    target: Value | None
    key: Value | None
    value: Value | None
    where: str
    root: object = None
    root_source: Source | None = None
    name: str = ""
    cell: Cell | None = None


def constant_value(value: object) -> Recorded:
    """A trace-time constant as a recorded value (non-builtin ones held by identity)."""
    if is_constant(value):
        return value
    return Original(ObjectSource(value, f"const:{stable_repr(value)}"), value)


class PlanRecorder:
    """Converts values into recorded values, allocating graph slots and new objects."""

    def __init__(self, ctx: TraceContext) -> None:
        self.ctx = ctx
        self.se = ctx.side_effects
        self.cells = ctx.cells
        self.slots: list[torch.fx.Node] = []
        self.slot_of: dict[torch.fx.Node, TensorSlot] = {}
        self.new_of: dict[int, Ref] = {}
        self.building: set[int] = set()

    def value(self, v: Value) -> Recorded:
        if isinstance(v, LazyNum):
            return v.ref
        if isinstance(v, SymV) or (isinstance(v, ConstV) and _symbolic(v.value)):
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
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
                    TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                    f"a {v.py_type.__qualname__} created inside the hook escapes it",
                )
            return tuple(self.value(x) for x in v.items)
        if isinstance(v, (ListV, DictV, SetV)):
            return self._new(v)
        if isinstance(v, FunctionV):
            new_cells = [c.name for c in v.closure if c.is_new]
            captured = (
                f", with the cells it closes over ({', '.join(new_cells)})" if new_cells else ""
            )
            raise refuse(
                TraceRefusal.ESCAPING_FUNCTION,
                f"function {v.name!r} created inside the hook escapes it (returned or stored)"
                f"{captured}",
                "define the function at module level or outside the hook",
            )
        raise refuse(
            TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
            f"a {v.py_type.__name__} created inside the hook escapes it",
        )

    def _new(self, v: ListV | DictV | SetV) -> Ref:
        key = id(v)
        if key in self.new_of:
            return self.new_of[key]
        if key in self.building:
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                "a container created by the hook contains itself",
            )
        if v.py_type not in (list, dict, set):
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                f"a {v.py_type.__qualname__} created inside the hook escapes it",
            )
        self.building.add(key)
        if isinstance(v, ListV):
            items = [self.value(x) for x in self.ctx.list_items(v)]
            ref = self.se.track_new(ObjKind.LIST, items)
        elif isinstance(v, SetV):
            elements = sorted(self.ctx.set_items(v), key=repr)
            ref = self.se.track_new(ObjKind.SET, [self._key(x) for x in elements])
        else:
            pairs = [(self._key(k), self.value(x)) for k, x in self.ctx.dict_items(v).items()]
            ref = self.se.track_new(ObjKind.DICT, pairs)
        self.building.discard(key)
        self.new_of[key] = ref
        return ref

    def _key(self, key: object) -> Any:
        if not is_constant(key):
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                f"a {type(key).__qualname__} key or set element would be replayed",
                "use str/int/bool/None keys (or tuples of them)",
            )
        return key

    def record(self, e: PendingEffect) -> None:
        """Record one buffered effect in the log (in program order)."""
        se = self.se
        se.where = e.where
        if e.op is OpKind.STORE_CELL:
            assert e.value is not None and e.cell is not None
            self.cells.store(e.cell, self.value(e.value))
            return
        if e.root is not None:  # a globals dict
            ns = se.track_existing(e.root, e.root_source)
            if e.op is OpKind.DICT_SETITEM:
                assert e.value is not None
                se.dict_setitem(ns, e.name, self.value(e.value))
            else:
                se.dict_delitem(ns, e.name)
            return
        assert isinstance(e.target, ObjectV)
        ref = se.track_existing(e.target.obj, e.target.source)
        key: Any = self._key(e.key.value) if isinstance(e.key, ConstV) else None
        value = self.value(e.value) if e.value is not None else None
        op = e.op
        if op is OpKind.STORE_ATTR:
            se.store_attr(ref, key, value)
        elif op is OpKind.DEL_ATTR:
            se.del_attr(ref, key)
        elif op is OpKind.LIST_APPEND:
            se.list_append(ref, value)
        elif op is OpKind.LIST_INSERT:
            se.list_insert(ref, key, value)
        elif op is OpKind.LIST_SETITEM:
            se.list_setitem(ref, key, value)
        elif op is OpKind.LIST_DELITEM:
            se.list_delitem(ref, key)
        elif op is OpKind.LIST_CLEAR:
            se.list_clear(ref)
        elif op is OpKind.DICT_SETITEM:
            se.dict_setitem(ref, key, value)
        elif op is OpKind.DICT_DELITEM:
            se.dict_delitem(ref, key)
        elif op is OpKind.DICT_CLEAR:
            se.dict_clear(ref)
        elif op is OpKind.SET_ADD:
            se.set_add(ref, self._key(_constant(e.value)))
        elif op is OpKind.SET_DISCARD:
            se.set_discard(ref, self._key(_constant(e.value)))
        elif op is OpKind.SET_CLEAR:
            se.set_clear(ref)
        else:  # pragma: no cover - the tracer buffers only the ops above
            raise AssertionError(op)

    def finish(self, result: Value, effects: list[PendingEffect]) -> tuple[ReplayPlan, int]:
        """The replay plan of ``result`` and ``effects``, and the number of user outputs."""
        try:
            returned = self.value(result)
            num_user = len(self.slots)
            for e in effects:
                try:
                    self.record(e)
                except Refused as exc:
                    exc.where = exc.where or e.where
                    raise
            return self.se.build(results=(returned,)), num_user
        except (SideEffectRefused, CellRefused) as exc:
            u = exc.reason
            refused = refuse(TraceRefusal.UNSUPPORTED_SIDE_EFFECT, u.explanation, u.hint)
            refused.where = u.where or None
            raise refused from None


def _constant(v: Value | None) -> object:
    assert isinstance(v, ConstV)
    return v.value


def _live(v: Value) -> object:
    """The trace-time object behind a sourced value (for ``loom_sidefx.concrete``)."""
    if isinstance(v, (ConstV, LazyNum)):
        return v.value
    if isinstance(v, ObjectV):
        return v.obj
    if isinstance(v, FunctionV):
        return v.fn
    return None


def _symbolic(value: object) -> bool:
    from .context import is_symbolic

    return is_symbolic(value)
