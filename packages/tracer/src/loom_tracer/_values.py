"""Symbolic values the tracer pushes on its stack.

Each Python object a hook touches is modelled by one ``Value``: constants
(immutable objects, callables, types, modules), numbers read from pre-existing
state that stay symbolic until used (``LazyNum``), tensors (an FX node plus a
fake tensor), containers, user objects, functions and iterators. A
pre-existing object has exactly one ``Value`` (keyed by identity in the
tracer) and a ``source``; objects created while tracing have no source.
Closure cells are not values: ``loom_cells`` models them (``FunctionV.closure``
and ``CellRefV`` hold its ``Cell`` handles).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from loom_cells import Cell
from loom_sidefx import Ref, Source
from loom_sidefx import Value as Recorded


class Value:
    """Base class of symbolic values."""

    source: Source | None = None

    @property
    def py_type(self) -> type:
        raise NotImplementedError


class NullValue(Value):
    """The NULL that CPython pushes below a callable."""

    @property
    def py_type(self) -> type:
        return type(None)


NULL = NullValue()


@dataclass(eq=False)
class ConstV(Value):
    """An immutable value known at trace time (or a callable, type or module held as is)."""

    value: Any
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return type(self.value)


@dataclass(eq=False)
class LazyNum(Value):
    """An int/float computed from pre-existing state: guarded only when its value is used."""

    value: int | float
    ref: Recorded
    leaves: tuple[tuple[Source, object], ...]
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return type(self.value)


@dataclass(eq=False)
class TensorV(Value):
    """A tensor: its node in the torch-level graph and a fake tensor with its metadata."""

    node: torch.fx.Node
    fake: torch.Tensor
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return torch.Tensor


@dataclass(eq=False)
class SymV(Value):
    """A size of a tensor with dynamic shapes (SymInt/SymFloat/SymBool) and its graph node."""

    node: torch.fx.Node
    value: Any

    @property
    def py_type(self) -> type:
        return type(self.value)


@dataclass(eq=False)
class SliceV(Value):
    """A slice with a symbolic bound (only tensors can be indexed with it)."""

    parts: tuple[Value, ...]

    @property
    def py_type(self) -> type:
        return slice


@dataclass(eq=False)
class ObjectV(Value):
    """A mutable object: a pre-existing instance of a user class, or a list, dict or set.

    Its state is not held here: ``ref`` is its handle in the trace's
    ``loom_sidefx`` log, which models its contents and attributes (lazily
    snapshotted for a pre-existing ``obj``; ``obj`` is None for one the hook
    created) and records its mutations.
    """

    obj: Any
    ref: Ref
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return type(self.obj)


@dataclass(eq=False)
class ListV(ObjectV):
    """A list (or list subclass)."""

    cls: type = list

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class TupleV(Value):
    """A tuple whose items are not all constants (or a namedtuple of them)."""

    items: tuple[Value, ...]
    source: Source | None = None
    cls: type = tuple
    fields: tuple[str, ...] = ()

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class DictV(ObjectV):
    """A dict (or subclass) keyed by constants."""

    cls: type = dict

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class SetV(ObjectV):
    """A set of constants."""

    cls: type = set

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class CellRefV(Value):
    """A closure cell pushed by ``LOAD_CLOSURE`` (for ``MAKE_FUNCTION``): the model's handle."""

    cell: Cell

    @property
    def py_type(self) -> type:
        return types.CellType


@dataclass(eq=False)
class FunctionV(Value):
    """A Python function: pre-existing (``fn``) or created by MAKE_FUNCTION while tracing."""

    code: types.CodeType
    globals: dict[str, Any]
    name: str
    closure: tuple[Cell, ...] = ()
    defaults: tuple[Value, ...] = ()
    kwdefaults: dict[str, Value] = field(default_factory=dict)
    fn: types.FunctionType | None = None
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return types.FunctionType


@dataclass(eq=False)
class MethodV(Value):
    """``self_v.name`` bound; ``func`` is the attribute found on the class (if any)."""

    self_v: Value
    name: str
    func: Any = None

    @property
    def py_type(self) -> type:
        return types.MethodType


@dataclass(eq=False)
class SuperV(Value):
    """``super()`` inside a method: attribute lookups start after ``cls`` in the MRO."""

    cls: type
    self_v: Value

    @property
    def py_type(self) -> type:
        return super


@dataclass(eq=False)
class IteratorV(Value):
    """An iterator over a snapshot of items (containers are not mutated while iterated)."""

    items: list[Value]
    pos: int = 0

    @property
    def py_type(self) -> type:
        return type(iter(()))


@dataclass(eq=False)
class GradModeV(Value):
    """``torch.no_grad()`` / ``torch.enable_grad()`` as a context manager."""

    enabled: bool

    @property
    def py_type(self) -> type:
        return torch.no_grad if not self.enabled else torch.enable_grad


@dataclass(eq=False)
class GradEnterV(Value):
    """The bound ``__enter__`` of a grad-mode context (3.14's LOAD_SPECIAL): sets ``enabled``."""

    enabled: bool

    @property
    def py_type(self) -> type:
        return types.MethodType


@dataclass(eq=False)
class GradExitV(Value):
    """The bound ``__exit__`` of a grad-mode context: restores ``previous``."""

    previous: bool

    @property
    def py_type(self) -> type:
        return types.MethodType


@dataclass(eq=False)
class OrderingV(Value):
    """A stream or an event (``_streams``): it only orders work, so the trace models no
    state of it. ``obj`` is the pre-existing object (None for one the hook made or asked
    for); ``cls`` is its exact class."""

    cls: type
    obj: Any = None
    source: Source | None = None

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class StreamV(OrderingV):
    """A stream: ``torch.cuda.Stream``, ``torch.cpu.Stream``, ``torch.Stream``."""


@dataclass(eq=False)
class EventV(OrderingV):
    """An event: ``torch.cuda.Event``, ``torch.cpu.Event``, ``torch.Event``."""


@dataclass(eq=False)
class StreamContextV(Value):
    """``torch.cuda.stream(s)``, a ``StreamContext`` or a stream in a ``with``: entering
    and leaving it only select the stream later work is ordered on (a no-op in a trace)."""

    cls: type
    label: str
    entered: Value

    @property
    def py_type(self) -> type:
        return self.cls


@dataclass(eq=False)
class NoOpCallV(Value):
    """The bound ``__enter__`` or ``__exit__`` of a stream context: calling it does
    nothing and returns ``result``."""

    result: Value

    @property
    def py_type(self) -> type:
        return types.MethodType
