"""The side-effect log of one trace: a mutable builder that ends in ``build()``.

The tracer tracks every object it may mutate or store (:meth:`SideEffects.track_existing`
for objects that existed before the hook ran, :meth:`SideEffects.track_new` for
objects the hook creates), records mutations through typed methods, and reads
the *current symbolic state* back through the view methods. Invariant: the live
objects are never mutated while tracing; mutations of pre-existing objects are
logged in program order, mutations of new objects only update their symbolic
state, and :meth:`SideEffects.build` keeps the new objects that escape.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from ._guards import Guard, GuardKind, SameElements
from ._kinds import BASE_OF_KIND, attr_refusal, has_instance_attr, kind_of, materialize_refusal
from ._ops import FunctionSpec, NewObject, Op, OpKind, PreexistingObject
from ._refusals import SideEffectRefusalKind, SideEffectRefused, Unsupported
from ._replay import ReplayPlan, checks_enabled
from ._sources import CellContentsSource, ItemSource, Source
from ._values import (
    Computed,
    Missing,
    MutationType,
    ObjKind,
    Original,
    Ref,
    Staged,
    TensorSlot,
    Value,
    is_constant,
)

__all__ = ["Checkpoint", "SideEffects"]

log = logging.getLogger("torchloom.sidefx")

_NO_DEFAULT: Any = object()


class _Entry:
    """Symbolic state of one tracked object (lazily snapshotted for pre-existing ones)."""

    __slots__ = (
        "attrs",
        "cell",
        "cls",
        "function",
        "items",
        "mapping",
        "obj",
        "ref",
        "source",
        "state",
        "touched",
    )

    def __init__(self, ref: Ref, obj: object, source: Source | None, cls: type) -> None:
        self.ref = ref
        self.obj = obj
        self.source = source
        self.cls = cls
        self.state = False  # container/cell contents snapshotted yet
        self.items: list[Value] = []
        self.mapping: dict[Any, Value] = {}
        self.attrs: dict[str, Value] = {}
        self.cell: Value = Missing.ABSENT
        self.function: FunctionSpec | None = None
        self.touched: set[Any] | None = set()  # dict keys the trace wrote (None: all)


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """A point to roll a :class:`SideEffects` log back to (see ``checkpoint``)."""

    num_entries: int
    num_ops: int
    mutated: frozenset[int]
    globals: tuple[tuple[str, Value], ...]
    num_slots: int
    states: tuple[tuple[Any, ...], ...] = dataclasses.field(repr=False)
    observed: tuple[Guard, ...] = ()


class SideEffects:
    """Builder of the side-effect log of one trace; ``build()`` yields a :class:`ReplayPlan`.

    Example (what a tracer records for ``G['log'].append({'loss': t})``)::

        se = SideEffects()
        log_ref = se.track_existing(globals_["log"], GlobalSource("log"))
        d = se.track_new(ObjKind.DICT, {"loss": se.new_tensor_slot()})
        se.list_append(log_ref, d)
        plan = se.build()
        plan.apply(Roots.of(hook, args), (loss_tensor,))

    Set ``where`` (user file:line) before each instruction: refusals and ops carry it.
    """

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._by_id: dict[int, Ref] = {}
        self._ops: list[Op] = []
        self._mutated: set[int] = set()
        self._globals: dict[str, Value] = {}
        self._num_slots = 0
        self._observed: dict[Guard, None] = {}
        self.where = ""

    # ------------------------------------------------------------------ tracking
    def track_existing(self, obj: object, source: Source | None) -> Ref:
        """Track an object that existed before the hook ran (once per object)."""
        ref = self._by_id.get(id(obj))
        if ref is not None:
            entry = self._entries[ref.index]
            if entry.source is None and source is not None:
                entry.source = source
            return ref
        ref = Ref(len(self._entries), MutationType.PREEXISTING, kind_of(obj))
        self._entries.append(_Entry(ref, obj, source, type(obj)))
        # NOTE: the entry keeps obj alive, so id(obj) cannot be reused during the trace.
        self._by_id[id(obj)] = ref
        return ref

    def tracked(self, obj: object) -> Ref | None:
        """The ref of an already tracked pre-existing object, if any."""
        return self._by_id.get(id(obj))

    def track_new(
        self,
        kind: ObjKind,
        initial: Iterable[Any] | Mapping[Any, Value] = (),
        *,
        cls: type | None = None,
    ) -> Ref:
        """Track a list, dict, set or plain object created by the hook.

        ``initial`` holds list/set items or dict pairs (a mapping or ``(key, value)``
        pairs); ``cls`` defaults to the base type and is required for ``OBJECT``.
        """
        if kind in (ObjKind.CELL, ObjKind.FUNCTION):
            raise TypeError("use track_new_cell / track_new_function")
        if cls is None:
            if kind is ObjKind.OBJECT:
                raise TypeError("track_new(ObjKind.OBJECT) needs cls=")
            cls = BASE_OF_KIND[kind]
        why = materialize_refusal(cls, kind)
        if why is not None:
            self._refuse(
                SideEffectRefusalKind.UNMATERIALIZABLE,
                f"cannot create a {kind.value} of class {cls!r} for replay: {why}",
                "build the object outside the hook, or use a pure-Python class",
            )
        entry = self._new_entry(kind, cls)
        if kind is ObjKind.LIST:
            entry.items = [self._value(v) for v in initial]
        elif kind is ObjKind.DICT:
            pairs = initial.items() if isinstance(initial, Mapping) else initial
            for key, value in pairs:
                self._dict_of(entry)[self._key(key)] = self._value(value)
        elif kind is ObjKind.SET:
            for key in initial:
                self._dict_of(entry)[self._key(key)] = None
        elif tuple(initial):
            raise TypeError("track_new(ObjKind.OBJECT) takes no initial contents")
        return entry.ref

    def track_new_cell(self, contents: Value = Missing.ABSENT) -> Ref:
        """Track a cell created by the hook (``MAKE_CELL``), empty by default."""
        entry = self._new_entry(ObjKind.CELL, types.CellType)
        entry.cell = contents if contents is Missing.ABSENT else self._value(contents)
        return entry.ref

    def track_new_function(
        self,
        code: types.CodeType,
        name: str,
        *,
        defaults: tuple[Value, ...] = (),
        closure: tuple[Ref, ...] = (),
        kwdefaults: Mapping[str, Value] | None = None,
    ) -> Ref:
        """Track a function created by the hook (``MAKE_FUNCTION``); ``closure`` are cell refs."""
        for cell in closure:
            if self._entry(cell).ref.kind is not ObjKind.CELL:
                raise TypeError(f"closure entry {cell} is not a cell")
        if len(closure) != len(code.co_freevars):
            raise TypeError(f"{code.co_name} needs {len(code.co_freevars)} closure cells")
        entry = self._new_entry(ObjKind.FUNCTION, types.FunctionType)
        entry.function = FunctionSpec(
            code,
            name,
            tuple(self._value(v) for v in defaults),
            tuple(closure),
            tuple((k, self._value(v)) for k, v in (kwdefaults or {}).items()),
        )
        return entry.ref

    def new_tensor_slot(self) -> TensorSlot:
        """Allocate the next extra graph output for a tensor stored into Python state."""
        self._num_slots += 1
        return TensorSlot(self._num_slots - 1)

    # --------------------------------------------------------------------- views
    def source_of(self, ref: Ref) -> Source | None:
        return self._entry(ref).source

    def live_object(self, ref: Ref) -> object:
        """The live pre-existing object behind ``ref`` (as seen at trace time)."""
        entry = self._entry(ref)
        if ref.is_new:
            raise TypeError(f"{ref} is new: it has no live object while tracing")
        return entry.obj

    @property
    def num_ops(self) -> int:
        """How many mutations of pre-existing state the log holds so far."""
        return len(self._ops)

    def is_mutated(self, ref: Ref) -> bool:
        """Whether this trace recorded a mutation of ``ref`` (always True for new objects)."""
        return ref.is_new or ref.index in self._mutated

    def list_items(self, ref: Ref) -> tuple[Value, ...]:
        """Current symbolic items of a tracked list."""
        entry = self._container(ref, ObjKind.LIST)
        self._observe_length(entry)
        return tuple(self._view(v) for v in entry.items)

    def dict_items(self, ref: Ref) -> tuple[tuple[Any, Value], ...]:
        """Current symbolic ``(key, value)`` pairs of a tracked dict, in order."""
        entry = self._container(ref, ObjKind.DICT)
        if entry.touched is not None and entry.source is not None and not ref.is_new:
            live: Any = entry.obj
            keys = tuple(dict.keys(live))
            self._observe(Guard(GuardKind.DICT_KEYS, entry.source, keys))
        return tuple((k, self._view(v)) for k, v in entry.mapping.items())

    def dict_lookup(self, ref: Ref, key: Any) -> Value:
        """``d[key]`` in the current symbolic state, or ``Missing.ABSENT``."""
        entry = self._container(ref, ObjKind.DICT)
        key = self._key(key)
        self._observe_key(entry, key)
        return self._view(entry.mapping.get(key, Missing.ABSENT))

    def set_items(self, ref: Ref) -> tuple[Any, ...]:
        """Current symbolic elements of a tracked set (constants, in insertion order)."""
        entry = self._container(ref, ObjKind.SET)
        if not ref.is_new and entry.source is not None:
            obj: Any = entry.obj
            elements = frozenset(set.__iter__(obj))
            self._observe(Guard(GuardKind.PREDICATE, entry.source, SameElements(elements)))
        return tuple(entry.mapping)

    def load_attr(self, ref: Ref, name: str) -> Value:
        """An instance attribute in the current symbolic state.

        Returns the stored value; ``Missing.ABSENT`` when the instance has no
        such attribute now (resolve it on the class); ``Missing.UNCHANGED`` when
        the trace did not write it (read the live pre-existing object).
        """
        entry = self._entry(ref)
        default = Missing.ABSENT if ref.is_new else Missing.UNCHANGED
        return self._view(entry.attrs.get(name, default))

    def load_global(self, name: str) -> Value:
        """A global in the current symbolic state (``UNCHANGED``: read the live globals)."""
        return self._view(self._globals.get(name, Missing.UNCHANGED))

    def load_cell(self, ref: Ref) -> Value:
        """A cell's contents now: a value, an :class:`Original`, or ``Missing.ABSENT`` (empty)."""
        entry = self._container(ref, ObjKind.CELL)
        return self._view(entry.cell)

    def function_spec(self, ref: Ref) -> FunctionSpec:
        """What ``track_new_function`` recorded for a new function."""
        spec = self._entry(ref).function
        if spec is None:
            raise TypeError(f"{ref} is not a function created by the hook")
        return spec

    # -------------------------------------------------------------- attributes
    def store_attr(self, ref: Ref, name: str, value: Value, *, generic: bool = False) -> None:
        """``obj.name = value``.

        By default a raw ``object.__setattr__`` (the tracer inlined any user
        ``__setattr__`` or property). With ``generic=True`` the store is replayed
        as ``setattr(obj, name, value)``, running the type's own ``__setattr__``
        and descriptors exactly once, at replay: for a pre-existing object whose
        ``__setattr__`` the tracer treats as opaque and known to store the value
        as given (e.g. ``torch.nn.Module``'s bookkeeping of buffers).
        """
        entry = self._attr_target(ref, name, generic)
        value = self._value(value)
        if ref.is_new:
            entry.attrs.pop(name, None)
        entry.attrs[name] = value
        self._log(OpKind.GENERIC_SETATTR if generic else OpKind.STORE_ATTR, ref, name, (value,))

    def del_attr(self, ref: Ref, name: str, *, generic: bool = False) -> None:
        """``del obj.name``: a raw ``object.__delattr__``, or ``delattr`` when ``generic``."""
        entry = self._attr_target(ref, name, generic)
        current = entry.attrs.get(name, Missing.ABSENT if ref.is_new else Missing.UNCHANGED)
        if current is Missing.UNCHANGED and not generic and not has_instance_attr(entry.obj, name):
            current = Missing.ABSENT
        if current is Missing.ABSENT:
            self._refuse(
                SideEffectRefusalKind.WOULD_RAISE,
                f"del of attribute {name!r} that the instance does not have raises AttributeError",
            )
        if ref.is_new:
            del entry.attrs[name]
        else:
            entry.attrs[name] = Missing.ABSENT
        self._log(OpKind.GENERIC_DELATTR if generic else OpKind.DEL_ATTR, ref, name)

    # -------------------------------------------------------------------- lists
    def list_append(self, ref: Ref, value: Value) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        value = self._value(value)
        entry.items.append(value)
        self._log(OpKind.LIST_APPEND, ref, None, (value,))

    def list_extend(self, ref: Ref, values: Iterable[Value]) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        vals = tuple(self._value(v) for v in values)
        entry.items.extend(vals)
        if vals:
            self._log(OpKind.LIST_EXTEND, ref, None, vals)

    def list_setitem(self, ref: Ref, index: int, value: Value) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        self._index(entry, index, "assignment")
        value = self._value(value)
        entry.items[index] = value
        self._log(OpKind.LIST_SETITEM, ref, index, (value,))

    def list_delitem(self, ref: Ref, index: int) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        self._index(entry, index, "deletion")
        del entry.items[index]
        self._log(OpKind.LIST_DELITEM, ref, index)

    def list_insert(self, ref: Ref, index: int, value: Value) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        if type(index) is not int:
            self._refuse(
                SideEffectRefusalKind.UNSUPPORTED_KEY, f"list index {index!r} is not an int"
            )
        value = self._value(value)
        entry.items.insert(index, value)
        self._log(OpKind.LIST_INSERT, ref, index, (value,))

    def list_pop(self, ref: Ref, index: int = -1) -> Value:
        """``lst.pop(index)``; returns the popped value."""
        entry = self._mutable(ref, ObjKind.LIST)
        self._index(entry, index, "pop")
        value = entry.items.pop(index)
        self._log(OpKind.LIST_POP, ref, index)
        return self._view(value)

    def list_clear(self, ref: Ref) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        entry.items.clear()
        self._log(OpKind.LIST_CLEAR, ref)

    def list_reverse(self, ref: Ref) -> None:
        entry = self._mutable(ref, ObjKind.LIST)
        entry.items.reverse()
        self._log(OpKind.LIST_REVERSE, ref)

    # -------------------------------------------------------------------- dicts
    def dict_setitem(self, ref: Ref, key: Any, value: Value) -> None:
        entry = self._mutable(ref, ObjKind.DICT)
        key, value = self._key(key), self._value(value)
        entry.mapping[key] = value
        self._touch(entry, key)
        self._log(OpKind.DICT_SETITEM, ref, key, (value,))

    def dict_delitem(self, ref: Ref, key: Any) -> None:
        self.dict_pop(ref, key)

    def dict_pop(self, ref: Ref, key: Any, default: Value = _NO_DEFAULT) -> Value:
        """``d.pop(key[, default])``; returns the popped value (or ``default``)."""
        entry = self._mutable(ref, ObjKind.DICT)
        key = self._key(key)
        self._observe_key(entry, key)
        if key not in entry.mapping:
            if default is _NO_DEFAULT:
                self._refuse(SideEffectRefusalKind.WOULD_RAISE, f"key {key!r} is missing: KeyError")
            return default
        value = entry.mapping.pop(key)
        self._touch(entry, key)
        self._log(OpKind.DICT_DELITEM, ref, key)
        return self._view(value)

    def dict_update(
        self, ref: Ref, pairs: Mapping[Any, Value] | Iterable[tuple[Any, Value]]
    ) -> None:
        """``d.update(pairs)``, recorded as one ``__setitem__`` per pair."""
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        for key, value in items:
            self.dict_setitem(ref, key, value)

    def dict_setdefault(self, ref: Ref, key: Any, default: Value = None) -> Value:
        current = self.dict_lookup(ref, key)
        if current is not Missing.ABSENT:
            return current
        self.dict_setitem(ref, key, default)
        return self.dict_lookup(ref, key)

    def dict_clear(self, ref: Ref) -> None:
        entry = self._mutable(ref, ObjKind.DICT)
        entry.mapping.clear()
        entry.touched = None
        self._log(OpKind.DICT_CLEAR, ref)

    # --------------------------------------------------------------------- sets
    def set_add(self, ref: Ref, element: Any) -> None:
        d = self._dict_of(self._mutable(ref, ObjKind.SET))
        element = self._key(element)
        d.setdefault(element, None)
        self._log(OpKind.SET_ADD, ref, element)

    def set_discard(self, ref: Ref, element: Any) -> None:
        d = self._dict_of(self._mutable(ref, ObjKind.SET))
        element = self._key(element)
        d.pop(element, None)
        self._log(OpKind.SET_DISCARD, ref, element)

    def set_remove(self, ref: Ref, element: Any) -> None:
        self._mutable(ref, ObjKind.SET)
        if self._key(element) not in self.set_items(ref):
            self._refuse(
                SideEffectRefusalKind.WOULD_RAISE, f"set element {element!r} is missing: KeyError"
            )
        self.set_discard(ref, element)

    def set_update(self, ref: Ref, elements: Iterable[Any]) -> None:
        for element in elements:
            self.set_add(ref, element)

    def set_clear(self, ref: Ref) -> None:
        self._dict_of(self._mutable(ref, ObjKind.SET)).clear()
        self._log(OpKind.SET_CLEAR, ref)

    # ---------------------------------------------------------- globals, cells
    def store_global(self, name: str, value: Value) -> None:
        """``global name; name = value`` in the hook's globals."""
        value = self._value(value)
        self._globals.pop(name, None)
        self._globals[name] = value
        self._ops.append(Op(OpKind.STORE_GLOBAL, None, name, (value,), self.where))

    def del_global(self, name: str) -> None:
        if self._globals.get(name, Missing.UNCHANGED) is Missing.ABSENT:
            self._refuse(
                SideEffectRefusalKind.WOULD_RAISE, f"global {name!r} is not defined: NameError"
            )
        self._globals[name] = Missing.ABSENT
        self._ops.append(Op(OpKind.DEL_GLOBAL, None, name, (), self.where))

    def store_cell(self, ref: Ref, value: Value) -> None:
        """``cell.cell_contents = value`` (``STORE_DEREF``)."""
        entry = self._mutable(ref, ObjKind.CELL)
        entry.cell = self._value(value)
        self._log(OpKind.STORE_CELL, ref, None, (entry.cell,))

    def del_cell(self, ref: Ref) -> None:
        """``del cell.cell_contents`` (``DELETE_DEREF``)."""
        entry = self._mutable(ref, ObjKind.CELL)
        if entry.cell is Missing.ABSENT:
            self._refuse(
                SideEffectRefusalKind.WOULD_RAISE, "deleting an empty cell raises NameError"
            )
        entry.cell = Missing.ABSENT
        self._log(OpKind.DEL_CELL, ref)

    def observed_guards(self) -> tuple[Guard, ...]:
        """Guards on what the views and checked ops observed of pre-existing containers.

        A list's items read by position, or a pop/setitem/delitem whose
        validity depends on the length: a LENGTH guard. A dict's items
        enumerated: DICT_KEYS. A key looked up (or popped) that the trace did not
        write: PRESENT or ABSENT. A set's elements read: the same elements.
        Add them to the tracer's own guards.
        """
        return tuple(self._observed)

    def _observe(self, guard: Guard) -> None:
        self._observed.setdefault(guard, None)

    def _observe_length(self, entry: _Entry) -> None:
        if not entry.ref.is_new and entry.source is not None:
            obj: Any = entry.obj
            n = list.__len__(obj)
            self._observe(Guard(GuardKind.LENGTH, entry.source, n))

    def _observe_key(self, entry: _Entry, key: Any) -> None:
        if entry.ref.is_new or entry.source is None:
            return
        if entry.touched is None or key in entry.touched:
            return
        obj: Any = entry.obj
        present = dict.__contains__(obj, key)
        kind = GuardKind.PRESENT if present else GuardKind.ABSENT
        self._observe(Guard(kind, ItemSource(entry.source, key), None))

    def _touch(self, entry: _Entry, key: Any) -> None:
        if entry.touched is not None:
            entry.touched.add(key)

    # ------------------------------------------------------------ speculation
    def checkpoint(self) -> Checkpoint:
        """Snapshot the log, to :meth:`rollback` to if a speculative trace is abandoned."""
        states = tuple(
            (
                e.source,
                e.state,
                list(e.items),
                dict(e.mapping),
                dict(e.attrs),
                e.cell,
                None if e.touched is None else set(e.touched),
            )
            for e in self._entries
        )
        return Checkpoint(
            len(self._entries),
            len(self._ops),
            frozenset(self._mutated),
            tuple(self._globals.items()),
            self._num_slots,
            states,
            tuple(self._observed),
        )

    def rollback(self, cp: Checkpoint) -> None:
        """Forget everything recorded and tracked since ``cp`` was taken."""
        for entry in self._entries[cp.num_entries :]:
            if not entry.ref.is_new:
                del self._by_id[id(entry.obj)]
        del self._entries[cp.num_entries :]
        del self._ops[cp.num_ops :]
        self._mutated = set(cp.mutated)
        self._globals = dict(cp.globals)
        self._num_slots = cp.num_slots
        self._observed = dict.fromkeys(cp.observed)
        for entry, (source, state, items, mapping, attrs, cell, touched) in zip(
            self._entries, cp.states, strict=True
        ):
            entry.source, entry.state, entry.cell = source, state, cell
            entry.items, entry.mapping, entry.attrs = list(items), dict(mapping), dict(attrs)
            entry.touched = None if touched is None else set(touched)

    # -------------------------------------------------------------------- build
    def build(
        self,
        results: tuple[Value, ...] = (),
        *,
        resolve: Callable[[Any], Value] | None = None,
    ) -> ReplayPlan:
        """The replay plan: ops on pre-existing state in program order, plus the
        new objects that escape into it (or into ``results``, values the caller
        wants materialized, e.g. the hook's return value).

        ``resolve`` records a :class:`Staged` value's payload; it is called for
        the staged values that reach the plan, results first, then the ops'
        arguments in program order (the contents of a new object when it is
        first reached), so a caller that allocates tensor slots in ``resolve``
        numbers the results' tensors first.
        """
        deep = self._resolver(resolve)
        results = tuple(deep(self._value(v)) for v in results)
        for i, op in enumerate(self._ops):
            self.where = op.where
            args = tuple(deep(a) for a in op.args)
            if any(a is not b for a, b in zip(args, op.args, strict=True)):
                self._ops[i] = dataclasses.replace(op, args=args)
        live: dict[int, None] = {}
        needed: dict[int, None] = {}
        stack: list[Value] = [v for op in self._ops for v in op.args]
        stack.extend(results)
        for op in self._ops:
            if op.target is not None:
                needed[op.target.index] = None
        while stack:
            v = stack.pop()
            if isinstance(v, Ref):
                if not v.is_new:
                    needed[v.index] = None
                elif v.index not in live:
                    live[v.index] = None
                    stack.extend(self._contents(self._entries[v.index]))
            elif type(v) is tuple:
                stack.extend(v)
            elif isinstance(v, Computed):
                stack.extend((v.lhs, v.rhs))
            elif isinstance(v, Original) and v.source is None:
                self._refuse(
                    SideEffectRefusalKind.NO_SOURCE,
                    "an item of a pre-existing object without a source escapes into Python state",
                )
        preexisting = []
        for index in sorted(needed):
            entry = self._entries[index]
            source = entry.source
            if source is None:
                self._refuse(
                    SideEffectRefusalKind.NO_SOURCE,
                    f"a pre-existing {entry.cls.__qualname__} without a source is mutated or stored",
                    "pass the object to the hook as an argument, or reach it from a global or closure",
                )
            preexisting.append(PreexistingObject(entry.ref, source))
        new_objects = tuple(self._new_object(self._entries[i]) for i in sorted(live))
        plan = ReplayPlan(
            tuple(preexisting), new_objects, tuple(self._ops), results, self._num_slots
        )
        pruned = sum(1 for e in self._entries if e.ref.is_new) - len(new_objects)
        log.debug(
            "built replay plan: %d ops, %d new objects kept, %d pruned",
            len(plan.ops),
            len(new_objects),
            pruned,
        )
        if checks_enabled():
            plan.check()
        return plan

    def resolve(
        self, values: tuple[Value, ...], resolve: Callable[[Any], Value]
    ) -> tuple[Value, ...]:
        """``values`` with every :class:`Staged` value recorded by ``resolve``, also in
        the contents of the new objects they reach (in order, depth first).

        ``build`` does this for its results and then the ops' arguments; a caller
        that must know what its results allocated (tensor slots) calls it first.
        """
        return tuple(self._resolver(resolve)(v) for v in values)

    def _resolver(self, resolve: Callable[[Any], Value] | None) -> Callable[[Value], Value]:
        reached: set[int] = set()

        def deep(v: Value) -> Value:
            if isinstance(v, Staged):
                if resolve is None:
                    self._refuse(
                        SideEffectRefusalKind.UNSUPPORTED_VALUE,
                        f"a staged {type(v.payload).__qualname__} reaches the plan unresolved",
                        "pass build(resolve=...)",
                    )
                return deep(self._value(resolve(v.payload)))
            if isinstance(v, Ref):
                if v.is_new and v.index not in reached:
                    reached.add(v.index)
                    entry = self._entries[v.index]
                    entry.items[:] = [deep(x) for x in entry.items]
                    for mapping in (entry.mapping, entry.attrs):
                        for k, x in mapping.items():
                            mapping[k] = deep(x)
                    entry.cell = deep(entry.cell)
                return v
            # NOTE: a value with nothing staged is kept as the same object: replay
            # shares constants by identity, as the hook did.
            if type(v) is tuple:
                items = tuple(deep(x) for x in v)
                return v if all(a is b for a, b in zip(items, v, strict=True)) else items
            if isinstance(v, Computed):
                lhs, rhs = deep(v.lhs), deep(v.rhs)
                return v if lhs is v.lhs and rhs is v.rhs else Computed(v.op, lhs, rhs)
            return v

        return deep

    # ------------------------------------------------------------------ helpers
    def _refuse(self, kind: SideEffectRefusalKind, explanation: str, hint: str = "") -> NoReturn:
        raise SideEffectRefused(Unsupported(kind, self.where, explanation, hint))

    def _new_entry(self, kind: ObjKind, cls: type) -> _Entry:
        ref = Ref(len(self._entries), MutationType.NEW, kind)
        entry = _Entry(ref, None, None, cls)
        entry.state = True
        self._entries.append(entry)
        return entry

    def _entry(self, ref: Ref) -> _Entry:
        if not isinstance(ref, Ref) or not 0 <= ref.index < len(self._entries):
            self._refuse(
                SideEffectRefusalKind.FOREIGN_REF, f"{ref!r} was not tracked by this builder"
            )
        entry = self._entries[ref.index]
        if entry.ref != ref:
            self._refuse(
                SideEffectRefusalKind.FOREIGN_REF, f"{ref!r} was not tracked by this builder"
            )
        return entry

    def _container(self, ref: Ref, kind: ObjKind) -> _Entry:
        entry = self._entry(ref)
        if ref.kind is not kind:
            self._refuse(
                SideEffectRefusalKind.WRONG_KIND,
                f"a {kind.value} operation on a {ref.kind.value} ({entry.cls.__qualname__})",
            )
        if not entry.state:
            self._snapshot(entry)
        return entry

    def _mutable(self, ref: Ref, kind: ObjKind) -> _Entry:
        entry = self._container(ref, kind)
        self._require_source(entry)
        return entry

    def _require_source(self, entry: _Entry) -> None:
        if not entry.ref.is_new and entry.source is None:
            self._refuse(
                SideEffectRefusalKind.NO_SOURCE,
                f"mutation of a pre-existing {entry.cls.__qualname__} that has no source",
                "reach the object from the hook's arguments, globals or closure",
            )

    def _attr_target(self, ref: Ref, name: str, generic: bool) -> _Entry:
        entry = self._entry(ref)
        if ref.kind is ObjKind.CELL:
            self._refuse(
                SideEffectRefusalKind.WRONG_KIND, "cells have no attributes: use store_cell"
            )
        self._require_source(entry)
        if generic:
            if ref.is_new:
                self._refuse(
                    SideEffectRefusalKind.WRONG_KIND,
                    "generic attribute stores apply to pre-existing objects only",
                    "trace the new object's __setattr__ and record raw stores",
                )
            return entry
        why = attr_refusal(entry.cls, name)
        if why is not None:
            self._refuse(
                SideEffectRefusalKind.DESCRIPTOR_ATTR,
                f"cannot replay a raw store of attribute {name!r}: {why}",
                "trace through the property/descriptor so only plain stores are recorded",
            )
        return entry

    def _snapshot(self, entry: _Entry) -> None:
        """Model a pre-existing container or cell as it is before the hook runs."""
        obj: Any = entry.obj
        src, kind = entry.source, entry.ref.kind
        if kind is ObjKind.LIST:
            items = list.copy(obj)
            entry.items = [
                self._original(x, None if src is None else ItemSource(src, i))
                for i, x in enumerate(items)
            ]
        elif kind is ObjKind.DICT:
            d: dict[Any, Value] = {}
            for k, v in dict.items(obj):
                if not is_constant(k):
                    self._refuse(
                        SideEffectRefusalKind.UNSUPPORTED_KEY,
                        f"pre-existing dict has the non-constant key of type {type(k).__qualname__}",
                    )
                d[k] = self._original(v, None if src is None else ItemSource(src, k))
            entry.mapping = d
        elif kind is ObjKind.SET:
            members: dict[Any, Value] = {}
            for k in set.__iter__(obj):
                if not is_constant(k):
                    self._refuse(
                        SideEffectRefusalKind.UNSUPPORTED_KEY,
                        f"pre-existing set holds a non-constant of type {type(k).__qualname__}",
                    )
                members[k] = None
            entry.mapping = members
        elif kind is ObjKind.CELL:
            try:
                contents = obj.cell_contents
            except ValueError:
                entry.cell = Missing.ABSENT
            else:
                entry.cell = self._original(
                    contents, None if src is None else CellContentsSource(src)
                )
        entry.state = True

    def _dict_of(self, entry: _Entry) -> dict[Any, Value]:
        """Dict pairs (DICT) or members (SET, values unused) of an entry."""
        return entry.mapping

    def _original(self, obj: object, source: Source | None) -> Value:
        # NOTE: constants stay Originals too: using the trace-time value is a
        # specialization the tracer must guard; replaying the source is not.
        if source is None and is_constant(obj):
            return obj
        return Original(source, obj)

    def _view(self, value: Value) -> Value:
        """Present an Original of a tracked object as that object's Ref."""
        if isinstance(value, Original) and not is_constant(value.obj):
            ref = self._by_id.get(id(value.obj))
            if ref is not None:
                return ref
        return value

    def _key(self, key: Any) -> Any:
        if not is_constant(key):
            self._refuse(
                SideEffectRefusalKind.UNSUPPORTED_KEY,
                f"a key or set element of type {type(key).__qualname__} is not a hashable constant",
                "use str/int/bool/None keys (or tuples of them)",
            )
        return key

    def _value(self, value: Value) -> Value:
        if isinstance(value, Ref):
            self._entry(value)
            return value
        if isinstance(value, TensorSlot | Original | Staged) or is_constant(value):
            return value
        if type(value) is tuple:
            return tuple(self._value(v) for v in value)
        if isinstance(value, Computed):
            return Computed(value.op, self._value(value.lhs), self._value(value.rhs))
        self._refuse(
            SideEffectRefusalKind.UNSUPPORTED_VALUE,
            f"cannot record a value of type {type(value).__qualname__}",
            "track the object first (track_existing/track_new) and store its Ref",
        )

    def _index(self, entry: _Entry, index: int, what: str) -> None:
        self._observe_length(entry)
        if type(index) is not int:
            self._refuse(
                SideEffectRefusalKind.UNSUPPORTED_KEY, f"list index {index!r} is not an int"
            )
        n = len(entry.items)
        if not -n <= index < n:
            self._refuse(
                SideEffectRefusalKind.WOULD_RAISE,
                f"list {what} index {index} out of range (len {n})",
            )

    def _log(self, kind: OpKind, ref: Ref, key: Any = None, args: tuple[Value, ...] = ()) -> None:
        if not ref.is_new:
            self._mutated.add(ref.index)
            self._ops.append(Op(kind, ref, key, args, self.where))

    def _contents(self, entry: _Entry) -> list[Value]:
        kind = entry.ref.kind
        out: list[Value] = []
        if kind is ObjKind.LIST:
            out.extend(entry.items)
        elif kind is ObjKind.DICT:
            out.extend(self._dict_of(entry).values())
        elif kind is ObjKind.CELL and entry.cell is not Missing.ABSENT:
            out.append(entry.cell)
        elif kind is ObjKind.FUNCTION and entry.function is not None:
            spec = entry.function
            out.extend(spec.defaults)
            out.extend(spec.closure)
            out.extend(v for _, v in spec.kwdefaults)
        out.extend(v for v in entry.attrs.values() if v is not Missing.ABSENT)
        return out

    def _new_object(self, entry: _Entry) -> NewObject:
        kind = entry.ref.kind
        items: tuple[Value, ...] = ()
        entries: tuple[tuple[Any, Value], ...] = ()
        if kind is ObjKind.LIST:
            items = tuple(entry.items)
        elif kind is ObjKind.SET:
            items = tuple(self._dict_of(entry))
        elif kind is ObjKind.DICT:
            entries = tuple(self._dict_of(entry).items())
        attrs = tuple(entry.attrs.items())
        contents = () if entry.cell is Missing.ABSENT else (entry.cell,)
        return NewObject(entry.ref, entry.cls, items, entries, attrs, contents, entry.function)
