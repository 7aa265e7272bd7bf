"""The replay plan: the side effects of one traced hook, applied after its graph runs.

A :class:`ReplayPlan` is immutable data (pre-existing objects with their
sources, escaping new objects with their final state, ops in program order,
result values). :meth:`ReplayPlan.apply` runs in four phases: fetch every
pre-existing object through its source (all before any mutation, so a source
always sees the state the trace saw), allocate new objects, fill them, then
apply the ops in order through the base type's methods (``list.append(obj, v)``,
``dict.__setitem__(obj, k, v)``) so an overridden method never runs twice. The
phases are compiled into closures once, on the first apply.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

from ._ops import (
    KEYED_OPS,
    OP_ARITY,
    OP_TARGET,
    NewObject,
    Op,
    OpKind,
    PreexistingObject,
    describe_type,
    describe_value,
)
from ._sources import Roots, Source
from ._values import (
    COMPUTE_OPS,
    Computed,
    Missing,
    MutationType,
    ObjKind,
    Original,
    Ref,
    TensorSlot,
    Value,
    is_constant,
)

__all__ = ["PlanCheckError", "ReplayPlan", "checks_enabled"]

Env = list[Any]
ValueFn = Callable[[Env, Sequence[Any]], Any]
OpFn = Callable[[Env, Sequence[Any], Roots], None]


def checks_enabled() -> bool:
    """Whether verifiers run on every build (``TORCHLOOM_CHECKS=1``, set by the test sessions)."""
    return os.environ.get("TORCHLOOM_CHECKS", "") == "1"


class PlanCheckError(ValueError):
    """A replay plan failed :meth:`ReplayPlan.check`; the message lists every problem."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Program:
    fetch: tuple[Callable[[Roots], Any], ...]
    make: tuple[Callable[[], Any], ...]
    make_functions: tuple[tuple[int, Callable[[Env, Sequence[Any], Roots], Any]], ...]
    fill: tuple[OpFn, ...]
    ops: tuple[OpFn, ...]
    results: tuple[ValueFn, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Side effects of one trace, replayed after the graph runs.

    >>> plan = SideEffects().build()       # doctest: +SKIP
    >>> plan.apply(Roots.of(hook, args), tensor_outputs)
    ()
    """

    preexisting: tuple[PreexistingObject, ...]
    new_objects: tuple[NewObject, ...]
    ops: tuple[Op, ...]
    results: tuple[Value, ...] = ()
    num_tensor_slots: int = 0
    _program: _Program | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def is_empty(self) -> bool:
        """True when replay has nothing to do (no op and no result)."""
        return not self.ops and not self.results

    @property
    def tensor_slots_used(self) -> tuple[int, ...]:
        """Sorted indices of the graph outputs the plan reads."""
        used: set[int] = set()
        for v in self._values():
            _walk(v, lambda x: used.add(x.index) if isinstance(x, TensorSlot) else None)
        return tuple(sorted(used))

    # ------------------------------------------------------------------ apply
    def apply(self, roots: Roots, tensor_outputs: Sequence[Any] = ()) -> tuple[Any, ...]:
        """Apply the side effects on live state; return the materialized ``results``."""
        prog = self._program
        if prog is None:
            prog = _compile(self)
            object.__setattr__(self, "_program", prog)
        env: Env = [get(roots) for get in prog.fetch]
        env.extend([make() for make in prog.make])
        for slot, make_fn in prog.make_functions:
            env[slot] = make_fn(env, tensor_outputs, roots)
        for fill in prog.fill:
            fill(env, tensor_outputs, roots)
        for op in prog.ops:
            op(env, tensor_outputs, roots)
        return tuple([r(env, tensor_outputs) for r in prog.results])

    # --------------------------------------------------------------- describe
    def names(self) -> dict[Ref, str]:
        """Deterministic names: a pre-existing ref by its source, a new one ``n0, n1, ...``."""
        names = {p.ref: p.source.describe() for p in self.preexisting}
        names.update({n.ref: f"n{i}" for i, n in enumerate(self.new_objects)})
        return names

    def describe(self) -> str:
        """Deterministic text of the plan (for fingerprints and reports)."""
        names = self.names()
        lines = [
            f"ReplayPlan: {len(self.ops)} ops, {len(self.new_objects)} new objects, "
            f"{self.num_tensor_slots} tensor slots"
        ]
        for new in self.new_objects:
            lines.append(f"  {names[new.ref]} = {_describe_new(new, names)}")
        for op in self.ops:
            lines.append(f"  {_describe_op(op, names)}")
        if self.results:
            lines.append("  return " + ", ".join(describe_value(v, names) for v in self.results))
        return "\n".join(lines)

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """Verify the plan's invariants; raise :class:`PlanCheckError` listing every problem."""
        problems: list[str] = []
        defined: dict[Ref, ObjKind] = {}
        for p in self.preexisting:
            if p.ref.mutation is not MutationType.PREEXISTING:
                problems.append(f"preexisting entry {p.ref} is not PREEXISTING")
            if not isinstance(p.source, Source):
                problems.append(f"preexisting entry {p.ref} has no source")
            if p.ref in defined:
                problems.append(f"{p.ref} is listed twice")
            defined[p.ref] = p.ref.kind
        for n in self.new_objects:
            if n.ref.mutation is not MutationType.NEW:
                problems.append(f"new object {n.ref} is not NEW")
            if n.ref in defined:
                problems.append(f"{n.ref} is listed twice")
            defined[n.ref] = n.ref.kind
            problems.extend(_check_new(n))
        for v in self._values():
            problems.extend(_check_value(v, defined, self.num_tensor_slots))
        for n in self.new_objects:
            if n.function is not None:
                for cell in n.function.closure:
                    if defined.get(cell) is not ObjKind.CELL:
                        problems.append(
                            f"function {n.function.name} closes over {cell}, not a known cell"
                        )
        for i, op in enumerate(self.ops):
            problems.extend(f"op {i} ({op.kind.value}): {p}" for p in _check_op(op, defined))
        if problems:
            raise PlanCheckError("corrupt ReplayPlan:\n  " + "\n  ".join(problems))

    def _values(self) -> list[Value]:
        out: list[Value] = [v for op in self.ops for v in op.args]
        out.extend(self.results)
        for n in self.new_objects:
            out.extend(n.items)
            out.extend(v for _, v in n.entries)
            out.extend(v for _, v in n.attrs)
            out.extend(n.contents)
            if n.function is not None:
                out.extend(n.function.defaults)
                out.extend(v for _, v in n.function.kwdefaults)
        return out


# ---------------------------------------------------------------------- checks
def _walk(value: Value, visit: Callable[[Value], object]) -> None:
    visit(value)
    if type(value) is tuple:
        for v in value:
            _walk(v, visit)
    elif isinstance(value, Computed):
        _walk(value.lhs, visit)
        _walk(value.rhs, visit)


def _check_value(value: Value, defined: dict[Ref, ObjKind], num_slots: int) -> list[str]:
    problems: list[str] = []

    def visit(v: Value) -> None:
        if isinstance(v, Ref):
            if v not in defined:
                problems.append(f"value refers to {v}, which the plan does not define")
        elif isinstance(v, TensorSlot):
            if not 0 <= v.index < num_slots:
                problems.append(
                    f"tensor slot {v.index} out of range (num_tensor_slots={num_slots})"
                )
        elif isinstance(v, Original):
            if not isinstance(v.source, Source):
                problems.append("an Original value has no source")
        elif isinstance(v, Computed):
            if v.op not in COMPUTE_OPS:
                problems.append(f"unknown Computed operator {v.op!r}")
        elif type(v) is not tuple and not is_constant(v):
            problems.append(f"value of type {type(v).__qualname__} is not replayable")

    _walk(value, visit)
    return problems


_NEW_BASES = {
    ObjKind.LIST: list,
    ObjKind.DICT: dict,
    ObjKind.SET: set,
    ObjKind.CELL: types.CellType,
    ObjKind.FUNCTION: types.FunctionType,
    ObjKind.OBJECT: object,
}


def _check_new(n: NewObject) -> list[str]:
    problems = []
    kind = n.ref.kind
    if not isinstance(n.cls, type) or not issubclass(n.cls, _NEW_BASES[kind]):
        problems.append(f"new {kind.value} {n.ref} has class {n.cls!r}")
    if (kind is ObjKind.FUNCTION) != (n.function is not None):
        problems.append(f"new {kind.value} {n.ref} function spec mismatch")
    if n.items and kind not in (ObjKind.LIST, ObjKind.SET):
        problems.append(f"new {kind.value} {n.ref} has items")
    if n.entries and kind is not ObjKind.DICT:
        problems.append(f"new {kind.value} {n.ref} has dict entries")
    if n.contents and (kind is not ObjKind.CELL or len(n.contents) != 1):
        problems.append(f"new {kind.value} {n.ref} has cell contents {len(n.contents)}")
    if kind is ObjKind.SET and not all(is_constant(k) for k in n.items):
        problems.append(f"new set {n.ref} holds a non-constant element")
    if not all(is_constant(k) for k, _ in n.entries):
        problems.append(f"new dict {n.ref} has a non-constant key")
    if not all(type(k) is str for k, _ in n.attrs):
        problems.append(f"new object {n.ref} has a non-str attribute name")
    return problems


def _check_op(op: Op, defined: dict[Ref, ObjKind]) -> list[str]:
    problems = []
    want = OP_TARGET[op.kind]
    if want is None:
        if op.target is not None:
            problems.append("a global op has a target")
    elif op.target is None:
        problems.append("missing target")
    else:
        if op.target.mutation is not MutationType.PREEXISTING:
            problems.append(
                f"target {op.target} is not pre-existing (new objects are materialized, not replayed)"
            )
        if op.target not in defined:
            problems.append(f"target {op.target} is not in the plan's preexisting table")
        if want != "any" and op.target.kind is not want:
            problems.append(f"target {op.target} is a {op.target.kind.value}")
        if want == "any" and op.target.kind is ObjKind.CELL:
            problems.append("attribute op on a cell")
    arity = OP_ARITY[op.kind]
    if arity >= 0 and len(op.args) != arity:
        problems.append(f"expects {arity} values, has {len(op.args)}")
    if op.kind in KEYED_OPS:
        if op.kind in (OpKind.STORE_ATTR, OpKind.DEL_ATTR, OpKind.STORE_GLOBAL, OpKind.DEL_GLOBAL):
            if type(op.key) is not str:
                problems.append(f"key {op.key!r} is not a str name")
        elif op.kind in (
            OpKind.LIST_SETITEM,
            OpKind.LIST_DELITEM,
            OpKind.LIST_INSERT,
            OpKind.LIST_POP,
        ):
            if type(op.key) is not int:
                problems.append(f"list index {op.key!r} is not an int")
        elif not is_constant(op.key):
            problems.append(f"key {op.key!r} is not a hashable constant")
    elif op.key is not None:
        problems.append(f"unexpected key {op.key!r}")
    return problems


# -------------------------------------------------------------------- describe
def _describe_new(n: NewObject, names: dict[Ref, str]) -> str:
    kind = n.ref.kind
    cls = describe_type(n.cls)

    def d(v: Value) -> str:
        return describe_value(v, names)

    if kind is ObjKind.FUNCTION and n.function is not None:
        f = n.function
        text = f"function {f.name} code={f.code.co_name}"
        if f.defaults:
            text += " defaults=(" + ", ".join(map(d, f.defaults)) + ")"
        if f.closure:
            text += " closure=(" + ", ".join(map(d, f.closure)) + ")"
        if f.kwdefaults:
            text += " kwdefaults={" + ", ".join(f"{k}={d(v)}" for k, v in f.kwdefaults) + "}"
    elif kind is ObjKind.CELL:
        text = f"cell({d(n.contents[0]) if n.contents else ''})"
    elif kind is ObjKind.LIST:
        text = f"{cls}[" + ", ".join(map(d, n.items)) + "]"
    elif kind is ObjKind.SET:
        text = f"{cls}{{" + ", ".join(map(d, n.items)) + "}"
    elif kind is ObjKind.DICT:
        text = f"{cls}{{" + ", ".join(f"{k!r}: {d(v)}" for k, v in n.entries) + "}"
    else:
        text = f"{cls}()"
    if n.attrs:
        text += " attrs{" + ", ".join(f"{k}={d(v)}" for k, v in n.attrs) + "}"
    return "new " + text


_METHOD_TEXT = {
    OpKind.LIST_APPEND: "list.append",
    OpKind.LIST_EXTEND: "list.extend",
    OpKind.LIST_SETITEM: "list.__setitem__",
    OpKind.LIST_DELITEM: "list.__delitem__",
    OpKind.LIST_INSERT: "list.insert",
    OpKind.LIST_POP: "list.pop",
    OpKind.LIST_CLEAR: "list.clear",
    OpKind.LIST_REVERSE: "list.reverse",
    OpKind.DICT_SETITEM: "dict.__setitem__",
    OpKind.DICT_DELITEM: "dict.__delitem__",
    OpKind.DICT_CLEAR: "dict.clear",
    OpKind.SET_ADD: "set.add",
    OpKind.SET_DISCARD: "set.discard",
    OpKind.SET_CLEAR: "set.clear",
}


def _describe_op(op: Op, names: dict[Ref, str]) -> str:
    target = names.get(op.target, "?") if op.target is not None else ""
    vals = [describe_value(v, names) for v in op.args]
    k = op.kind
    if k is OpKind.STORE_ATTR:
        return f"{target}.{op.key} = {vals[0]}"
    if k is OpKind.DEL_ATTR:
        return f"del {target}.{op.key}"
    if k is OpKind.STORE_GLOBAL:
        return f"G[{op.key!r}] = {vals[0]}"
    if k is OpKind.DEL_GLOBAL:
        return f"del G[{op.key!r}]"
    if k is OpKind.STORE_CELL:
        return f"{target}.cell_contents = {vals[0]}"
    if k is OpKind.DEL_CELL:
        return f"del {target}.cell_contents"
    args = [target]
    if op.kind in KEYED_OPS:
        args.append(repr(op.key))
    if k is OpKind.LIST_EXTEND:
        args.append("[" + ", ".join(vals) + "]")
    else:
        args.extend(vals)
    return f"{_METHOD_TEXT[k]}({', '.join(args)})"


# --------------------------------------------------------------------- compile
def _compile(plan: ReplayPlan) -> _Program:
    slots: dict[Any, int] = {}
    fetch: list[Callable[[Roots], Any]] = []
    for p in plan.preexisting:
        slots[p.ref] = len(fetch)
        fetch.append(p.source.compile())

    def originals(v: Value) -> None:
        if isinstance(v, Original) and v.source is not None and v.source not in slots:
            slots[v.source] = len(fetch)
            fetch.append(v.source.compile())

    for v in plan._values():
        _walk(v, originals)
    make: list[Callable[[], Any]] = []
    functions: list[NewObject] = []
    for n in plan.new_objects:
        slots[n.ref] = len(fetch) + len(make)
        if n.function is not None:
            functions.append(n)
            make.append(_none)
        else:
            make.append(_allocator(n))

    def value_fn(v: Value) -> ValueFn:
        return _value_fn(v, slots)

    make_functions = tuple((slots[n.ref], _function_maker(n, slots)) for n in functions)
    fill = tuple(f for n in plan.new_objects for f in _fillers(n, value_fn, slots))
    ops = tuple(_op_fn(op, value_fn, slots) for op in plan.ops)
    results = tuple(value_fn(v) for v in plan.results)
    return _Program(tuple(fetch), tuple(make), make_functions, fill, ops, results)


def _none() -> None:
    return None


def _allocator(n: NewObject) -> Callable[[], Any]:
    kind, cls = n.ref.kind, n.cls
    if kind is ObjKind.CELL:
        return types.CellType
    if cls in (list, dict, set, object):
        return cls
    base: Any = {ObjKind.LIST: list, ObjKind.DICT: dict, ObjKind.SET: set}.get(kind, object)
    return lambda: base.__new__(cls)


def _value_fn(v: Value, slots: dict[Any, int]) -> ValueFn:
    if isinstance(v, Ref):
        i = slots[v]
        return lambda env, t: env[i]
    if isinstance(v, Original):
        i = slots[v.source]
        return lambda env, t: env[i]
    if isinstance(v, TensorSlot):
        k = v.index
        return lambda env, t: t[k]
    if isinstance(v, Computed):
        fn, lhs, rhs = COMPUTE_OPS[v.op], _value_fn(v.lhs, slots), _value_fn(v.rhs, slots)
        return lambda env, t: fn(lhs(env, t), rhs(env, t))
    if type(v) is tuple and not is_constant(v):
        fns = tuple(_value_fn(x, slots) for x in v)
        return lambda env, t: tuple([f(env, t) for f in fns])
    return lambda env, t: v


def _function_maker(
    n: NewObject, slots: dict[Any, int]
) -> Callable[[Env, Sequence[Any], Roots], Any]:
    spec = n.function
    assert spec is not None
    code, name = spec.code, spec.name
    cells = tuple(slots[c] for c in spec.closure)
    defaults = tuple(_value_fn(v, slots) for v in spec.defaults)
    kwdefaults = tuple((k, _value_fn(v, slots)) for k, v in spec.kwdefaults)

    def make(env: Env, t: Sequence[Any], roots: Roots) -> Any:
        fn = types.FunctionType(
            code,
            roots.globals,
            name,
            tuple([f(env, t) for f in defaults]) if defaults else None,
            tuple([env[i] for i in cells]) if cells else None,
        )
        if kwdefaults:
            fn.__kwdefaults__ = {k: f(env, t) for k, f in kwdefaults}
        return fn

    return make


def _fillers(
    n: NewObject, value_fn: Callable[[Value], ValueFn], slots: dict[Any, int]
) -> list[OpFn]:
    i = slots[n.ref]
    out: list[OpFn] = []
    kind = n.ref.kind
    if kind is ObjKind.LIST and n.items:
        items = tuple(value_fn(v) for v in n.items)
        out.append(lambda env, t, r: list.extend(env[i], [f(env, t) for f in items]))
    elif kind is ObjKind.SET and n.items:
        elements = tuple(n.items)
        out.append(lambda env, t, r: set.update(env[i], elements))
    elif kind is ObjKind.DICT and n.entries:
        entries = tuple((k, value_fn(v)) for k, v in n.entries)

        def fill_dict(env: Env, t: Sequence[Any], r: Roots) -> None:
            d = env[i]
            for k, f in entries:
                dict.__setitem__(d, k, f(env, t))

        out.append(fill_dict)
    elif kind is ObjKind.CELL and n.contents:
        f = value_fn(n.contents[0])

        def fill_cell(env: Env, t: Sequence[Any], r: Roots) -> None:
            env[i].cell_contents = f(env, t)

        out.append(fill_cell)
    if n.attrs:
        attrs = tuple((k, value_fn(v)) for k, v in n.attrs if v is not Missing.ABSENT)

        def fill_attrs(env: Env, t: Sequence[Any], r: Roots) -> None:
            obj = env[i]
            for k, f in attrs:
                object.__setattr__(obj, k, f(env, t))

        out.append(fill_attrs)
    return out


def _raw_setattr(obj: object, name: str, value: Any) -> None:
    if isinstance(obj, type):
        type.__setattr__(obj, name, value)
    else:
        object.__setattr__(obj, name, value)


def _raw_delattr(obj: object, name: str) -> None:
    if isinstance(obj, type):
        type.__delattr__(obj, name)
    else:
        object.__delattr__(obj, name)


def _op_fn(op: Op, value_fn: Callable[[Value], ValueFn], slots: dict[Any, int]) -> OpFn:
    """One closure per op; the target index, key and value getter are bound at compile time."""
    k, key = op.kind, op.key
    i = slots[op.target] if op.target is not None else -1
    fns = tuple(value_fn(v) for v in op.args)
    vf = fns[0] if fns else _no_value
    match k:
        case OpKind.STORE_ATTR:
            return lambda env, t, r: _raw_setattr(env[i], key, vf(env, t))
        case OpKind.DEL_ATTR:
            return lambda env, t, r: _raw_delattr(env[i], key)
        case OpKind.LIST_APPEND:
            return lambda env, t, r: list.append(env[i], vf(env, t))
        case OpKind.LIST_EXTEND:
            return lambda env, t, r: list.extend(env[i], [f(env, t) for f in fns])
        case OpKind.LIST_SETITEM:
            return lambda env, t, r: list.__setitem__(env[i], key, vf(env, t))
        case OpKind.LIST_DELITEM:
            return lambda env, t, r: list.__delitem__(env[i], key)
        case OpKind.LIST_INSERT:
            return lambda env, t, r: list.insert(env[i], key, vf(env, t))
        case OpKind.LIST_POP:
            return lambda env, t, r: list.__delitem__(env[i], key)
        case OpKind.LIST_CLEAR:
            return lambda env, t, r: list.clear(env[i])
        case OpKind.LIST_REVERSE:
            return lambda env, t, r: list.reverse(env[i])
        case OpKind.DICT_SETITEM:
            return lambda env, t, r: dict.__setitem__(env[i], key, vf(env, t))
        case OpKind.DICT_DELITEM:
            return lambda env, t, r: dict.__delitem__(env[i], key)
        case OpKind.DICT_CLEAR:
            return lambda env, t, r: dict.clear(env[i])
        case OpKind.SET_ADD:
            return lambda env, t, r: set.add(env[i], key)
        case OpKind.SET_DISCARD:
            return lambda env, t, r: set.discard(env[i], key)
        case OpKind.SET_CLEAR:
            return lambda env, t, r: set.clear(env[i])
        case OpKind.STORE_GLOBAL:
            return lambda env, t, r: r.globals.__setitem__(key, vf(env, t))
        case OpKind.DEL_GLOBAL:
            return lambda env, t, r: r.globals.__delitem__(key)
        case OpKind.STORE_CELL:
            return lambda env, t, r: setattr(env[i], "cell_contents", vf(env, t))
        case OpKind.DEL_CELL:
            return lambda env, t, r: delattr(env[i], "cell_contents")
    raise AssertionError(f"no replay for {k}")


def _no_value(env: Env, t: Sequence[Any]) -> Any:
    raise AssertionError("op has no value")
