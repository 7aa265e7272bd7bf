"""The replay plan: the side effects of one traced hook, applied after its graph runs.

A :class:`ReplayPlan` is immutable data (pre-existing objects with their
sources, escaping new objects with their final state, ops in program order,
result values). :meth:`ReplayPlan.apply` runs in four phases: fetch every
pre-existing object through its source (all before any mutation, so a source
always sees the state the trace saw), allocate new objects, fill them, then
apply the ops in order through the base type's methods (``list.append(obj, v)``,
``dict.__setitem__(obj, k, v)``) so an overridden method never runs twice. The
phases are generated as one straight-line Python function on the first apply.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

from ._codegen import Emitter
from ._kinds import BASE_OF_KIND
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
    MutationType,
    ObjKind,
    Original,
    Ref,
    TensorSlot,
    Value,
    is_constant,
)

__all__ = ["PlanCheckError", "ReplayPlan", "checks_enabled"]


def checks_enabled() -> bool:
    """Whether verifiers run on every build (``TORCHLOOM_CHECKS=1``, set by the test sessions)."""
    return os.environ.get("TORCHLOOM_CHECKS", "") == "1"


class PlanCheckError(ValueError):
    """A replay plan failed :meth:`ReplayPlan.check`; the message lists every problem."""


_Program = tuple[Callable[[Roots, Sequence[Any]], tuple[Any, ...]], str]


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

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: the generated program is a cache: pickles carry the data only.
        return (
            ReplayPlan,
            (self.preexisting, self.new_objects, self.ops, self.results, self.num_tensor_slots),
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
        return prog[0](roots, tensor_outputs)

    def program_text(self) -> str:
        """The generated Python source of :meth:`apply` (for debugging and reports)."""
        prog = self._program
        if prog is None:
            prog = _compile(self)
            object.__setattr__(self, "_program", prog)
        return prog[1]

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


def _check_new(n: NewObject) -> list[str]:
    problems = []
    kind = n.ref.kind
    if not isinstance(n.cls, type) or not issubclass(n.cls, BASE_OF_KIND[kind]):
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


_NAME_KEYED = frozenset(
    {
        OpKind.STORE_ATTR,
        OpKind.DEL_ATTR,
        OpKind.GENERIC_SETATTR,
        OpKind.GENERIC_DELATTR,
        OpKind.STORE_GLOBAL,
        OpKind.DEL_GLOBAL,
    }
)


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
        if op.kind in _NAME_KEYED:
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
    if k is OpKind.GENERIC_SETATTR:
        return f"setattr({target}, {op.key!r}, {vals[0]})"
    if k is OpKind.GENERIC_DELATTR:
        return f"delattr({target}, {op.key!r})"
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
_ALLOC_BASE = {ObjKind.LIST: list, ObjKind.DICT: dict, ObjKind.SET: set, ObjKind.OBJECT: object}
_LITERAL_NEW: dict[type, str] = {list: "[]", dict: "{}", set: "set()"}
_INFIX = frozenset(COMPUTE_OPS) - {"min", "max"}


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


def _compile(plan: ReplayPlan) -> tuple[Callable[[Roots, Sequence[Any]], tuple[Any, ...]], str]:
    """Generate ``replay(roots, t)``: fetch, allocate, fill, ops, results (see module doc)."""
    em = Emitter("    ")
    em.namespace.update(_setattr=_raw_setattr, _delattr=_raw_delattr, _Cell=types.CellType)
    names: dict[Ref, str] = {}
    for p in plan.preexisting:
        names[p.ref] = em.source(p.source)

    def hoist(v: Value) -> None:
        if isinstance(v, Original) and v.source is not None:
            em.source(v.source)

    for v in plan._values():
        _walk(v, hoist)

    def val(v: Value) -> str:
        if isinstance(v, Ref):
            return names[v]
        if isinstance(v, Original):
            assert v.source is not None
            return em.source(v.source)
        if isinstance(v, TensorSlot):
            return f"t[{v.index}]"
        if isinstance(v, Computed):
            lhs, rhs = val(v.lhs), val(v.rhs)
            return f"({lhs} {v.op} {rhs})" if v.op in _INFIX else f"{v.op}({lhs}, {rhs})"
        if type(v) is tuple and not is_constant(v):
            inner = ", ".join(val(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        return em.const(v)

    for i, n in enumerate(plan.new_objects):
        names[n.ref] = f"n{i}"
    for n in plan.new_objects:
        name, kind = names[n.ref], n.ref.kind
        if kind is ObjKind.CELL:
            em.emit(f"{name} = _Cell()")
        elif kind is not ObjKind.FUNCTION:
            literal = _LITERAL_NEW.get(n.cls)
            base = _ALLOC_BASE[kind].__name__
            em.emit(f"{name} = {literal or f'{base}.__new__({em.const(n.cls)})'}")
    for n in plan.new_objects:
        if n.function is not None:
            f = n.function
            defaults = f"({', '.join(val(d) for d in f.defaults)},)" if f.defaults else "None"
            closure = f"({', '.join(names[c] for c in f.closure)},)" if f.closure else "None"
            em.emit(
                f"{names[n.ref]} = {em.const(types.FunctionType)}"
                f"({em.const(f.code)}, g, {em.const(f.name)}, {defaults}, {closure})"
            )
            if f.kwdefaults:
                pairs = ", ".join(f"{em.const(k)}: {val(v)}" for k, v in f.kwdefaults)
                em.emit(f"{names[n.ref]}.__kwdefaults__ = {{{pairs}}}")
    for n in plan.new_objects:
        _emit_fill(em, n, names[n.ref], val)
    for op in plan.ops:
        em.emit(_op_line(op, names.get(op.target, "") if op.target else "", val, em))
    results = ", ".join(val(v) for v in plan.results)
    em.emit(f"return ({results},)" if len(plan.results) == 1 else f"return ({results})")
    header = [
        "def replay(roots, t):",
        "    a = roots.args",
        "    g = roots.globals",
        "    c = roots.closure",
    ]
    fn = em.function("replay", header, [], "<loom replay>")
    return fn, em.text


def _emit_fill(em: Emitter, n: NewObject, name: str, val: Callable[[Value], str]) -> None:
    kind = n.ref.kind
    if kind is ObjKind.LIST and n.items:
        em.emit(f"list.extend({name}, ({', '.join(val(v) for v in n.items)},))")
    elif kind is ObjKind.SET and n.items:
        em.emit(f"set.update({name}, {em.const(tuple(n.items))})")
    elif kind is ObjKind.DICT:
        for k, v in n.entries:
            if n.cls is dict:
                em.emit(f"{name}[{em.const(k)}] = {val(v)}")
            else:
                em.emit(f"dict.__setitem__({name}, {em.const(k)}, {val(v)})")
    elif kind is ObjKind.CELL and n.contents:
        em.emit(f"{name}.cell_contents = {val(n.contents[0])}")
    for k, v in n.attrs:
        em.emit(f"object.__setattr__({name}, {em.const(k)}, {val(v)})")


def _op_line(op: Op, target: str, val: Callable[[Value], str], em: Emitter) -> str:
    k = em.const(op.key)
    v = val(op.args[0]) if op.args else ""
    match op.kind:
        case OpKind.STORE_ATTR:
            return f"_setattr({target}, {k}, {v})"
        case OpKind.DEL_ATTR:
            return f"_delattr({target}, {k})"
        case OpKind.GENERIC_SETATTR:
            return f"setattr({target}, {k}, {v})"
        case OpKind.GENERIC_DELATTR:
            return f"delattr({target}, {k})"
        case OpKind.LIST_EXTEND:
            return f"list.extend({target}, ({', '.join(val(x) for x in op.args)},))"
        case OpKind.STORE_GLOBAL:
            return f"g[{k}] = {v}"
        case OpKind.DEL_GLOBAL:
            return f"del g[{k}]"
        case OpKind.STORE_CELL:
            return f"{target}.cell_contents = {v}"
        case OpKind.DEL_CELL:
            return f"del {target}.cell_contents"
    method = _METHOD_TEXT[op.kind]
    args = [target]
    if op.kind in KEYED_OPS:
        args.append(k)
    if op.args:
        args.append(v)
    return f"{method}({', '.join(args)})"
