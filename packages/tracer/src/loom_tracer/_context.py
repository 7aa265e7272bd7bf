"""The state of one trace: the torch-level graph, guards, the side-effect log, object identities.

``TraceContext`` is shared by every frame of one ``trace_hook`` call (the hook
and the functions it inlines). It turns pre-existing objects into ``Value``s
(``wrap``: one value per object, keyed by identity, with a source and the
guards that make the model valid), records tensor work on fake tensors into a
torch-level FX graph (``call_torch``), buffers side effects in program order,
and at the end converts everything into graph outputs and a ``ReplayPlan``.
Every closure cell, pre-existing or made while tracing, is modelled by one
``loom_cells.CellModel`` (``cells``) on the trace's side-effect log.
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from loom_cells import Cell, CellModel, CellRefusalKind, CellRefused
from loom_sidefx import (
    AttrSource,
    CellContentsSource,
    Guard,
    GuardKind,
    ItemSource,
    Missing,
    ObjectSource,
    ObjKind,
    Original,
    Ref,
    ReplayPlan,
    SameElements,
    SideEffectRefusalKind,
    SideEffectRefused,
    SideEffects,
    Source,
    Staged,
    concrete,
    is_constant,
)
from loom_sidefx import Value as Recorded

from . import _torch_compat
from ._effects import PlanRecorder
from ._kinds import SYMBOLIC_TYPES, is_const, is_symbolic
from ._lift import NumberInput, lift_numbers
from ._predicates import EqualTo, TensorMeta
from ._refusal import Refused, TraceRefusalKind, refuse
from ._streams import ordering_value
from ._values import (
    ConstV,
    DictV,
    FunctionV,
    IteratorV,
    LazyNum,
    ListV,
    ObjectV,
    SetV,
    SliceV,
    SymV,
    TensorV,
    TupleV,
    Value,
)


def operand(ctx: TraceContext, v: Value) -> Any:
    """The Python value an operator works on: symbolic sizes stay symbolic."""
    if isinstance(v, ConstV):
        return v.value
    return ctx.specialize(v)


def slot(cls: type, name: str) -> Any:
    """``cls.name`` looked up as an untyped value (for comparing special methods)."""
    return getattr(cls, name, None)


def globals_source(namespace: dict[str, Any]) -> ObjectSource:
    """A globals dict held by identity (the hook's or an inlined function's module)."""
    return ObjectSource(namespace, f"globals:{namespace.get('__name__', '?')}")


def global_source(namespace: dict[str, Any], name: str) -> ItemSource:
    """Global ``name`` of ``namespace``."""
    return ItemSource(globals_source(namespace), name)


def function_source(fn: types.FunctionType) -> ObjectSource:
    """A function reached by no source (a method found on a class, say), held by identity."""
    return ObjectSource(fn, f"function {fn.__module__}.{fn.__qualname__}")


# Immutable singletons guarded by identity.
_SINGLETON_TYPES = (torch.dtype, torch.layout, torch.memory_format, type(Ellipsis))


def cell_guard_policy(value: object) -> GuardKind | None:
    """How ``loom_cells`` guards a read of a pre-existing cell's contents.

    The guard that ``TraceContext.wrap`` puts on the value it models: none for
    tensors (a metadata guard, as a graph input) and numbers (guarded only if
    the trace specializes on them), the type of containers and objects (their
    contents are guarded as they are read), the value of constants and the
    identity of functions, modules and types.
    """
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    if isinstance(value, _SINGLETON_TYPES):
        return GuardKind.IDENTITY
    if is_const(value):
        return GuardKind.EQUALS if is_constant(value) else None
    if isinstance(value, (tuple, list, dict, set)):
        return GuardKind.TYPE
    if isinstance(value, torch.nn.Module):
        return None  # refused by wrap
    if isinstance(
        value,
        (
            types.FunctionType,
            types.ModuleType,
            type,
            types.BuiltinFunctionType,
            types.MethodDescriptorType,
        ),
    ) or (callable(value) and type(value).__module__.startswith("torch")):
        return GuardKind.IDENTITY
    return GuardKind.TYPE


def cell_refusal(exc: CellRefused) -> Refused:
    """The tracer's refusal for a refusal of the cell model."""
    u = exc.reason
    if u.kind is CellRefusalKind.EMPTY_CELL:
        kind = TraceRefusalKind.HOOK_RAISES
    elif u.kind is CellRefusalKind.NO_SOURCE:
        kind = TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT
    else:
        kind = TraceRefusalKind.TRACER_ERROR
    refused = refuse(kind, u.explanation, u.hint)
    refused.where = u.where or None
    return refused


_SIDE_EFFECT_REFUSAL = {
    SideEffectRefusalKind.WOULD_RAISE: TraceRefusalKind.HOOK_RAISES,
    SideEffectRefusalKind.UNSUPPORTED_KEY: TraceRefusalKind.UNSUPPORTED_VALUE,
}


def side_effect_refusal(exc: SideEffectRefused) -> Refused:
    """The tracer's refusal for a refusal of the side-effect log met while tracing."""
    u = exc.reason
    kind = _SIDE_EFFECT_REFUSAL.get(u.kind, TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT)
    refused = refuse(kind, u.explanation, u.hint)
    refused.where = u.where or None
    return refused


_NewT = TypeVar("_NewT", bound=ObjectV)


class TraceContext:
    """Everything one trace accumulates; see the module docstring."""

    def __init__(self, fake_mode: Any, *, max_depth: int = 16) -> None:
        self.graph = torch.fx.Graph()
        self.fake_mode = fake_mode
        self.max_depth = max_depth
        self.inputs: list[tuple[Source, torch.fx.Node, torch.Tensor]] = []
        #: Inputs that are numbers lifted from pre-existing state (see ``_lift``).
        self.input_numbers: dict[torch.fx.Node, NumberInput] = {}
        self.guards: dict[Guard, None] = {}
        self.known: dict[int, Value] = {}
        self.keepalive: list[object] = []
        # The globals dicts (by id) and names the trace wrote: their values are in the log.
        self.global_writes: set[tuple[int, str]] = set()
        self.grad_enabled = torch.is_grad_enabled()
        self.codes: list[types.CodeType] = []
        self.opaque_calls: list[str] = []
        #: Calls folded at trace time (``_process_constants``), as ``name(args) -> result``.
        self.process_constants: dict[str, None] = {}
        #: Stream and event operations dropped from the graph (``_streams``), with their line.
        self.stream_ops: list[str] = []
        self.where = "<hook>"
        # The model of Python state: every list, dict, set, object, globals
        # dict and cell the hook touches is tracked by the side-effect log
        # (cells through `cells`), which holds their symbolic contents (tracer
        # values as `Staged`) and records mutations of pre-existing ones in
        # program order.
        self.side_effects = SideEffects()
        self.cells = CellModel(self.side_effects, guard_policy=cell_guard_policy)
        self.new_values: dict[Ref, Value] = {}

    def record_process_constant(self, call: str) -> None:
        """A call folded at trace time (no guard: its result is fixed for the process)."""
        self.process_constants[call] = None

    def record_stream_op(self, op: str) -> None:
        """A stream or event operation the trace drops (it only orders work)."""
        self.stream_ops.append(op)

    # ------------------------------------------------------------------ guards
    def guard(self, source: Source | None, kind: GuardKind, expected: Any) -> None:
        if source is None:
            return
        self.guards.setdefault(Guard(kind, source, expected), None)

    def guard_equals(self, source: Source | None, value: Any) -> None:
        """The value at ``source`` must equal the immutable ``value`` (same exact type)."""
        if source is None:
            return
        if isinstance(value, _SINGLETON_TYPES):
            self.guard(source, GuardKind.IDENTITY, value)
        elif is_constant(value):
            self.guard(source, GuardKind.EQUALS, value)
        elif type(value) is set:
            self.guard(source, GuardKind.TYPE, set)
            self.guard(source, GuardKind.PREDICATE, SameElements(frozenset(value)))
        else:
            self.guard(source, GuardKind.PREDICATE, EqualTo(value))

    def guard_attr_absent(self, source: Source | None, name: str) -> None:
        """``name`` must stay out of the instance ``__dict__`` of the object at ``source``."""
        if source is not None:
            self.guard(ItemSource(AttrSource(source, "__dict__"), name), GuardKind.ABSENT, None)

    def specialize(self, v: Value) -> Any:
        """The concrete Python value of a constant-like value, guarding what it came from."""
        if isinstance(v, ConstV):
            if is_symbolic(v.value):
                raise refuse(
                    TraceRefusalKind.UNSUPPORTED_VALUE,
                    f"a symbolic size ({v.value}) is used as a Python value (branch, format, key or state)",
                    "use it only in tensor operations, or trace with static shapes",
                )
            return v.value
        if isinstance(v, LazyNum):
            for source, value in v.leaves:
                self.guard_equals(source, value)
            return v.value
        if isinstance(v, SymV):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE,
                f"a symbolic size ({v.value}) is used as a Python value (branch, format, key or state)",
                "use it only in tensor operations, or trace with static shapes",
            )
        if isinstance(v, TensorV):
            raise refuse(
                TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW,
                "a tensor's value is used as a Python value (branch, bool, int, format or key)",
                "branch on tensor metadata (dtype, shape, device) instead, or use torch.where",
            )
        if isinstance(v, TupleV):
            return tuple(self.specialize(x) for x in v.items)
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE,
            f"a {v.py_type.__name__} is used where a constant is needed",
        )

    def type_of(self, v: Value) -> type:
        """``type(v)``, guarding the type of a lazily read number."""
        if isinstance(v, SymV):
            self.specialize(v)  # a SymInt is an int to the hook: refuse rather than lie
        if isinstance(v, LazyNum):
            for source, value in v.leaves:
                self.guard(source, GuardKind.TYPE, type(value))
        return v.py_type

    # ---------------------------------------------------------------- wrapping
    def remember(self, obj: object, v: Value) -> Value:
        self.known[id(obj)] = v
        self.keepalive.append(obj)
        return v

    def wrap(self, obj: Any, source: Source | None) -> Value:
        """Model a pre-existing object reached through ``source``."""
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            known = self.known.get(id(obj))
            if known is not None and not is_const(obj):
                if source is not None and known.source is not None and known.source != source:
                    self.guard(source, GuardKind.SAME_AS, known.source)
                return known
        if isinstance(obj, torch.Tensor):
            return self.remember(obj, self.tensor_input(obj, source))
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            if source is None:
                return ConstV(obj)
            return LazyNum(obj, Original(source, obj), ((source, obj),), source)
        if is_const(obj):
            self.guard_equals(source, obj)
            return ConstV(obj, source)
        if type(obj) is tuple or (isinstance(obj, tuple) and hasattr(type(obj), "_fields")):
            self.guard(source, GuardKind.TYPE, type(obj))
            self.guard(source, GuardKind.LENGTH, len(obj))
            items = tuple(
                self.wrap(x, ItemSource(source, i) if source is not None else None)
                for i, x in enumerate(obj)
            )
            return TupleV(items, source, type(obj))
        if isinstance(obj, types.FunctionType):
            self.guard(source, GuardKind.IDENTITY, obj)
            return self.remember(obj, self.function_value(obj, source))
        ordering = ordering_value(self, obj, source)
        if ordering is not None:  # not remembered: which stream it is never matters
            return ordering
        if isinstance(obj, types.ModuleType):
            self.guard(source, GuardKind.IDENTITY, obj)
            return ConstV(obj, source)
        if isinstance(obj, (type, types.BuiltinFunctionType, types.MethodDescriptorType)) or (
            callable(obj)
            and type(obj).__module__.startswith("torch")
            and not isinstance(obj, torch.nn.Module)
        ):
            self.guard(source, GuardKind.IDENTITY, obj)
            return ConstV(obj, source)
        if isinstance(obj, torch.nn.Module):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE,
                f"an nn.Module ({type(obj).__qualname__}) is read by the hook",
                "pass the module's tensors or settings to the hook through a closure instead",
            )
        cls = type(obj)
        container = next((c for c in (ListV, DictV, SetV) if isinstance(obj, c.cls)), None)
        if container is not None:
            self.guard(source, GuardKind.TYPE, cls)
            ref = self.side_effects.track_existing(obj, source)
            return self.remember(obj, container(obj, ref, source, cls=cls))
        if (
            hasattr(obj, "__dict__")
            and slot(cls, "__getattribute__") is object.__getattribute__
            and not isinstance(obj, (types.MethodType, types.GeneratorType))
        ):
            self.guard(source, GuardKind.TYPE, cls)
            ref = self.side_effects.track_existing(obj, source)
            return self.remember(obj, ObjectV(obj, ref, source))
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE,
            f"cannot model a {cls.__module__}.{cls.__qualname__} read from {source}",
        )

    def function_value(self, fn: types.FunctionType, source: Source | None) -> FunctionV:
        self.side_effects.where = self.where
        cells = self.cells.closure_of(fn, source or function_source(fn))
        # Defaults are wrapped (and guarded) only when a call uses them: see default_value.
        return FunctionV(fn.__code__, fn.__globals__, fn.__name__, cells, (), {}, fn, source)

    def default_value(self, fn: FunctionV, key: int | str) -> Value:
        """The default of positional parameter ``key`` (an index) or keyword-only ``key``."""
        if fn.fn is None:
            return fn.defaults[key] if isinstance(key, int) else fn.kwdefaults[key]
        name = "__defaults__" if isinstance(key, int) else "__kwdefaults__"
        raw = getattr(fn.fn, name)[key]
        base = AttrSource(fn.source, name) if fn.source is not None else None
        return self.wrap(raw, ItemSource(base, key) if base is not None else None)

    def tensor_input(self, t: torch.Tensor, source: Source | None) -> TensorV:
        if source is None:
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE, "a tensor with no source (a default value?)"
            )
        self.guard(source, GuardKind.PREDICATE, TensorMeta.of(t))
        return self._input(source, _torch_compat.to_fake(self.fake_mode, t))

    def _input(self, source: Source, fake: torch.Tensor) -> TensorV:
        first = next((n for n in self.graph.nodes if n.op != "placeholder"), None)
        if first is None:
            node = self.graph.placeholder(f"in{len(self.inputs)}")
        else:
            with self.graph.inserting_before(first):
                node = self.graph.placeholder(f"in{len(self.inputs)}")
        node.meta["val"] = fake
        self.inputs.append((source, node, fake))
        return TensorV(node, fake, source)

    def number_input(self, source: Source, value: int | float, device: torch.device) -> TensorV:
        """A number at ``source`` as a 0-d tensor input (float64 or int64 on ``device``),
        one per source, dtype and device; its type is guarded, not its value."""
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        for (src, node, fake), spec in ((i, self.input_numbers.get(i[1])) for i in self.inputs):
            if src == source and spec == (dtype, device):
                return TensorV(node, fake, source)
        self.guard(source, GuardKind.TYPE, type(value))
        with self.fake_mode:
            fake = torch.empty((), dtype=dtype, device=device)
        lifted = self._input(source, fake)
        self.input_numbers[lifted.node] = (dtype, device)
        return lifted

    # -------------------------------------------------------------- containers
    @contextlib.contextmanager
    def log(self) -> Iterator[SideEffects]:
        """The side-effect log, at the current line; its refusals become the tracer's."""
        self.side_effects.where = self.where
        try:
            yield self.side_effects
        except SideEffectRefused as exc:
            raise side_effect_refusal(exc) from None

    def unstage(self, value: Recorded, source: Source | None = None) -> Value:
        """The tracer value of what the log holds: staged as stored, else the
        pre-existing object (``Original``, a tracked ``Ref``) or constant, wrapped."""
        if isinstance(value, Staged):
            v: Value = value.payload
            return v
        if isinstance(value, Original):
            return self.wrap(value.obj, value.source or source)
        if isinstance(value, Ref):
            if value.is_new:
                return self.new_values[value]
            se = self.side_effects
            return self.wrap(se.live_object(value), se.source_of(value) or source)
        return self.wrap(concrete(value), source)

    def _new(self, v: _NewT) -> _NewT:
        self.new_values[v.ref] = v
        return v

    def new_list(self, items: Iterable[Value] = ()) -> ListV:
        """A list the hook creates."""
        with self.log() as se:
            ref = se.track_new(ObjKind.LIST, [Staged(x) for x in items])
        return self._new(ListV(None, ref))

    def new_dict(self, items: Iterable[tuple[Any, Value]] = ()) -> DictV:
        """A dict the hook creates (constant keys)."""
        with self.log() as se:
            ref = se.track_new(ObjKind.DICT, [(k, Staged(x)) for k, x in items])
        return self._new(DictV(None, ref))

    def new_set(self, items: Iterable[Any] = ()) -> SetV:
        """A set the hook creates (constant elements)."""
        with self.log() as se:
            ref = se.track_new(ObjKind.SET, items)
        return self._new(SetV(None, ref))

    def list_items(self, v: ListV) -> list[Value]:
        """The list's current items (a pre-existing list's length is guarded)."""
        with self.log() as se:
            items = se.list_items(v.ref)
        src = v.source
        return [
            self.unstage(x, ItemSource(src, i) if src is not None else None)
            for i, x in enumerate(items)
        ]

    def dict_items(self, v: DictV) -> dict[Any, Value]:
        """The dict's current items (a pre-existing dict's keys are guarded)."""
        with self.log() as se:
            pairs = se.dict_items(v.ref)
        src = v.source
        return {
            k: self.unstage(x, ItemSource(src, k) if src is not None else None) for k, x in pairs
        }

    def set_items(self, v: SetV) -> set[Any]:
        """The set's current elements (a pre-existing set's elements are guarded)."""
        with self.log() as se:
            return set(se.set_items(v.ref))

    def require_base_protocol(self, v: Value, *dunders: str) -> None:
        """Refuse a container subclass that overrides one of ``dunders`` (not modelled)."""
        if not isinstance(v, (ListV, DictV, SetV, TupleV)):
            return
        cls = v.py_type
        base = next((b for b in (list, dict, set, tuple) if issubclass(cls, b)), None)
        if base is None or cls is base or cls is torch.Size:
            return
        for name in dunders:
            if slot(cls, name) is not slot(base, name):
                raise refuse(
                    TraceRefusalKind.UNSUPPORTED_VALUE,
                    f"{cls.__qualname__} overrides {name}",
                    "override only methods the hook calls by name (such as append)",
                )

    def sequence_items(self, v: Value) -> list[Value]:
        """The items of an iterable value, for iteration, unpacking and builtins."""
        self.require_base_protocol(v, "__iter__", "__len__")

        if isinstance(v, ListV):
            return list(self.list_items(v))
        if isinstance(v, TupleV):
            return list(v.items)
        if isinstance(v, DictV):
            return [ConstV(k) for k in self.dict_items(v)]
        if isinstance(v, SetV):
            return [ConstV(k) for k in sorted(self.set_items(v), key=repr)]
        if isinstance(v, IteratorV):
            items = v.items[v.pos :]
            v.pos = len(v.items)
            return items
        if isinstance(v, (ConstV, LazyNum)):
            value = self.specialize(v)
            if isinstance(value, (tuple, range, str, torch.Size, frozenset)):
                return [ConstV(x) for x in value]
        if isinstance(v, TensorV):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE,
                "iterating over a tensor",
                "use t.unbind(0) to get a tuple of tensors",
            )
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE, f"cannot iterate over a {v.py_type.__name__}"
        )

    # ----------------------------------------------------------------- effects
    def store_cell(self, cell: Cell, value: Value) -> None:
        """``STORE_DEREF``: the model holds ``value``; a pre-existing cell's write is replayed."""
        self.side_effects.where = self.where
        try:
            self.cells.store(cell, Staged(value))
        except CellRefused as exc:
            raise cell_refusal(exc) from None
        except SideEffectRefused as exc:
            raise side_effect_refusal(exc) from None

    def load_cell(self, cell: Cell) -> Value:
        """``LOAD_DEREF``: what the trace stored, or the pre-existing contents (guarded by the model)."""
        self.side_effects.where = self.where
        try:
            value = self.cells.load(cell)
        except CellRefused as exc:
            raise cell_refusal(exc) from None
        source = self.side_effects.source_of(cell.ref)
        return self.unstage(value, CellContentsSource(source) if source is not None else None)

    def load_global(self, namespace: dict[str, Any], name: str) -> Value:
        source = global_source(namespace, name)
        if (id(namespace), name) in self.global_writes:
            with self.log() as se:
                written = se.dict_lookup(se.track_existing(namespace, None), name)
            if written is Missing.ABSENT:
                raise refuse(TraceRefusalKind.HOOK_RAISES, f"name {name!r} is not defined")
            return self.unstage(written, source)
        if name in namespace:
            return self.wrap(namespace[name], source)
        builtins_ns = namespace.get("__builtins__", __builtins__)
        if isinstance(builtins_ns, types.ModuleType):
            builtins_ns = vars(builtins_ns)
        if name not in builtins_ns:
            raise refuse(TraceRefusalKind.HOOK_RAISES, f"name {name!r} is not defined")
        self.guard(source, GuardKind.ABSENT, None)
        return ConstV(builtins_ns[name])

    def store_global(self, namespace: dict[str, Any], name: str, value: Value | None) -> None:
        """``STORE_GLOBAL`` (``value``) or ``DELETE_GLOBAL`` (None): a mutation of the globals dict."""
        self.global_writes.add((id(namespace), name))
        with self.log() as se:
            ref = se.track_existing(namespace, globals_source(namespace))
            if value is not None:
                se.dict_setitem(ref, name, Staged(value))
            else:
                se.dict_delitem(ref, name)

    # ------------------------------------------------------------------ tensors
    def lower_arg(self, v: Value) -> tuple[Any, Any]:
        """(fake value, graph argument) of a value passed to a torch function."""
        if isinstance(v, (TensorV, SymV)):
            return (v.fake if isinstance(v, TensorV) else v.value), v.node
        if isinstance(v, (ConstV, LazyNum)):
            value = operand(self, v)
            if isinstance(value, (types.ModuleType, types.FunctionType)):
                raise refuse(
                    TraceRefusalKind.UNSUPPORTED_VALUE, f"{value!r} passed to a torch function"
                )
            return value, value
        if isinstance(v, SliceV):
            lowered = [self.lower_arg(x) for x in v.parts]
            return slice(*[p[0] for p in lowered]), slice(*[p[1] for p in lowered])
        if isinstance(v, (TupleV, ListV)):
            items = list(v.items) if isinstance(v, TupleV) else self.list_items(v)
            pairs = [self.lower_arg(x) for x in items]
            kind: Callable[[Any], Any] = tuple if isinstance(v, TupleV) else list
            return kind(p[0] for p in pairs), kind(p[1] for p in pairs)
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE,
            f"a {v.py_type.__name__} is passed to a torch function",
        )

    def call_torch(
        self,
        target: Any,
        args: list[Value],
        kwargs: dict[str, Value],
        *,
        method: str | None = None,
        opaque: bool = False,
    ) -> Value:
        """Run ``target`` on fake tensors and record it in the graph (numbers read from
        pre-existing state become graph inputs where the op allows: ``_lift``)."""

        def run_fake(fake_args: Sequence[Any], fake_kwargs: Mapping[str, Any]) -> Any:
            with self.fake_mode, torch.set_grad_enabled(self.grad_enabled):
                if method is not None:
                    return getattr(fake_args[0], method)(*fake_args[1:], **fake_kwargs)
                return target(*fake_args, **fake_kwargs)

        if not opaque:
            args, kwargs = lift_numbers(self, run_fake, args, kwargs)
        lowered = [self.lower_arg(a) for a in args]
        lowered_kw = {k: self.lower_arg(v) for k, v in kwargs.items()}
        fake_args = [x[0] for x in lowered]
        fake_kwargs = {k: x[0] for k, x in lowered_kw.items()}
        name = method or getattr(target, "__name__", repr(target))
        try:
            out = run_fake(fake_args, fake_kwargs)
        except Exception as exc:
            kind_name = type(exc).__name__
            if "DataDependent" in kind_name or "DynamicOutputShape" in kind_name:
                raise refuse(
                    TraceRefusalKind.DATA_DEPENDENT_OP,
                    f"{name} needs tensor values (or gives a data-dependent shape): {kind_name}",
                    "keep the hook's Python logic on tensor metadata",
                ) from None
            raise refuse(
                TraceRefusalKind.TORCH_ERROR, f"{name} failed on fake tensors: {kind_name}: {exc}"
            ) from None
        node_args = tuple(x[1] for x in lowered)
        node_kwargs = {k: x[1] for k, x in lowered_kw.items()}
        if method is not None:
            node = self.graph.call_method(method, node_args, node_kwargs)
        else:
            node = self.graph.call_function(target, node_args, node_kwargs)
        node.meta["loom_where"] = self.where
        if opaque:
            node.meta["loom_opaque"] = True
            self.opaque_calls.append(f"{getattr(target, '__module__', '?')}.{name}")
        return self.wrap_result(out, node)

    def wrap_result(self, out: Any, node: torch.fx.Node) -> Value:
        if isinstance(out, torch.Tensor):
            node.meta["val"] = out
            return TensorV(node, out)
        if isinstance(out, SYMBOLIC_TYPES):
            return SymV(node, out)
        if isinstance(out, (tuple, list)) and any(
            isinstance(x, (torch.Tensor, *SYMBOLIC_TYPES)) for x in out
        ):
            items: list[Value] = []
            for i, x in enumerate(out):
                if isinstance(x, (torch.Tensor, *SYMBOLIC_TYPES)):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    items.append(self.wrap_result(x, item))
                elif is_const(x):
                    items.append(ConstV(x))
                else:
                    raise refuse(
                        TraceRefusalKind.UNSUPPORTED_VALUE,
                        f"torch returned a {type(x).__name__} inside a tuple",
                    )
            if isinstance(out, list):
                return self.new_list(items)
            return TupleV(tuple(items), None, type(out), _field_names(out))
        if is_const(out) or isinstance(out, (torch.finfo, torch.iinfo)):
            # NOTE: the node stays: it may be an in-place op (setitem) returning None.
            return ConstV(out)
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_VALUE, f"a torch call returned a {type(out).__name__}"
        )

    # ------------------------------------------------------------------ finish
    def guard_no_aliasing(self) -> None:
        """Mutable pre-existing objects modelled as distinct must stay distinct objects.

        Two lists that were different objects while tracing could be one object
        at call time, and then a read of one would see writes to the other.
        """
        by_kind: dict[type, list[Source]] = {}
        for v in self.known.values():
            if isinstance(v, ObjectV) and v.source is not None and v.obj is not None:
                base = next(b for b in (list, dict, set, object) if isinstance(v.obj, b))
                by_kind.setdefault(base, []).append(v.source)
        for sources in by_kind.values():
            for i, a in enumerate(sources):
                for b in sources[i + 1 :]:
                    self.guard(a, GuardKind.DISTINCT_FROM, b)

    def finish(self, result: Value) -> tuple[torch.fx.GraphModule, ReplayPlan, int]:
        """Graph outputs + replay plan for the hook's return value and buffered effects."""
        self.guard_no_aliasing()
        recorder = PlanRecorder(self.side_effects)
        plan, num_user = recorder.finish(result)
        for guard in (*recorder.se.observed_guards(), *self.cells.guards()):
            self.guards.setdefault(guard, None)
        self.graph.output(tuple(recorder.slots))
        gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        return gm, plan, num_user


def _field_names(out: tuple[Any, ...]) -> tuple[str, ...]:
    """Field names of a namedtuple or a structseq (``torch.return_types.max``), in order."""
    fields = getattr(type(out), "_fields", None)
    if fields is not None:
        return tuple(fields)
    names: dict[int, str] = {}
    for name, attr in vars(type(out)).items():
        if isinstance(attr, types.MemberDescriptorType) and not name.startswith("_"):
            value = getattr(out, name)
            for i, item in enumerate(out):
                if item is value:
                    names.setdefault(i, name)
    return tuple(names.get(i, "") for i in range(len(out)))
