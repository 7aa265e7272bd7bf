"""Turning the values a trace ended with into replay references and graph outputs.

``PlanBuilder`` walks the hook's return value and every buffered effect and
gives each value a ``Ref``: constants as they are, pre-existing objects by
source (read before any effect), tensors as graph outputs (user outputs are
allocated first, because the return value is walked first), escaping new
containers as ``NewObject``s with their final contents. Anything that cannot
be rebuilt after the graph (functions or objects created in the hook,
symbolic sizes) is refused here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from .context import is_symbolic
from .refusal import TraceRefusal, refuse
from .replay import (
    BINARY_OPS,
    BinRef,
    ConstRef,
    NewKind,
    NewObject,
    NewRef,
    Ref,
    SourceRef,
    TensorSlot,
)
from .sources import Source
from .values import (
    CellV,
    ConstV,
    DictV,
    FunctionV,
    LazyNum,
    ListV,
    SetV,
    SymV,
    TensorV,
    TupleV,
    Value,
)

if TYPE_CHECKING:
    from .context import TraceContext


class PlanBuilder:
    """Converts values into replay references, allocating graph slots and new objects."""

    def __init__(self, ctx: TraceContext) -> None:
        self.ctx = ctx
        self.slots: list[torch.fx.Node] = []
        self.slot_of: dict[torch.fx.Node, int] = {}
        self.reads: dict[str, Source] = {}
        self.new_objects: list[NewObject] = []
        self.new_of: dict[int, int] = {}
        self.building: set[int] = set()

    def read(self, source: Source) -> SourceRef:
        self.reads.setdefault(source.describe(), source)
        return SourceRef(source)

    def ref(self, v: Value) -> Ref:
        if isinstance(v, LazyNum):
            return self._lazy(v.ref)
        if isinstance(v, SymV) or (isinstance(v, ConstV) and is_symbolic(v.value)):
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                "a symbolic size would be stored or returned as a Python value",
                "return or store tensors, or trace with static shapes",
            )
        if isinstance(v, ConstV):
            if is_symbolic(v.value):
                raise refuse(
                    TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                    f"a symbolic size ({v.value}) would be stored or returned as a Python value",
                    "return or store tensors, or trace with static shapes",
                )
            return ConstRef(v.value)
        if v.source is not None and not isinstance(v, CellV):
            return self.read(v.source)
        if isinstance(v, TensorV):
            if v.node not in self.slot_of:
                self.slot_of[v.node] = len(self.slots)
                self.slots.append(v.node)
            return TensorSlot(self.slot_of[v.node])
        if isinstance(v, (ListV, TupleV, DictV, SetV)):
            return self._new(v)
        if isinstance(v, FunctionV):
            raise refuse(
                TraceRefusal.ESCAPING_FUNCTION,
                f"function {v.name!r} created inside the hook escapes it (returned or stored)",
                "define the function at module level or outside the hook",
            )
        raise refuse(
            TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
            f"a {v.py_type.__name__} created inside the hook escapes it",
        )

    def _lazy(self, ref: Ref) -> Ref:
        if isinstance(ref, SourceRef):
            return self.read(ref.source)
        if isinstance(ref, BinRef):
            assert ref.op in BINARY_OPS
            return BinRef(ref.op, self._lazy(ref.lhs), self._lazy(ref.rhs))
        return ref

    def _new(self, v: ListV | TupleV | DictV | SetV) -> Ref:
        key = id(v)
        if key in self.new_of:
            return NewRef(self.new_of[key])
        if key in self.building:
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                "a container created by the hook contains itself",
            )
        self.building.add(key)
        if isinstance(v, TupleV):
            kind, items = NewKind.TUPLE, tuple(self.ref(x) for x in v.items)
        elif isinstance(v, ListV):
            kind, items = NewKind.LIST, tuple(self.ref(x) for x in self.ctx.list_items(v))
        elif isinstance(v, SetV):
            kind, items = (
                NewKind.SET,
                tuple(ConstRef(x) for x in sorted(self.ctx.set_items(v), key=repr)),
            )
        else:
            flat: list[Ref] = []
            for k, x in self.ctx.dict_items(v).items():
                flat += [ConstRef(k), self.ref(x)]
            kind, items = NewKind.DICT, tuple(flat)
        if v.py_type not in (list, tuple, dict, set):
            raise refuse(
                TraceRefusal.UNSUPPORTED_SIDE_EFFECT,
                f"a {v.py_type.__qualname__} created inside the hook escapes it",
            )
        self.building.discard(key)
        self.new_of[key] = len(self.new_objects)
        self.new_objects.append(NewObject(kind, items))
        return NewRef(self.new_of[key])
