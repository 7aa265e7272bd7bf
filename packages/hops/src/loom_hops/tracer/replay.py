"""The replay plan: what a traced hook does to Python state, applied after its graph runs.

A plan has three parts, applied in this order:

1. ``reads``: every pre-existing value the plan refers to (``SourceRef``) is read
   first, so all of them see the state from *before* the hook ran, as the
   trace did;
2. ``new_objects``: containers the hook created and let escape are built with
   their final contents (later objects may refer to earlier ones);
3. ``effects``: mutations of pre-existing objects, in program order, through
   the base-class operation (``list.append(obj, v)``), because user overrides
   were already inlined by the tracer.

Values are ``Ref``s: a constant, a graph output (``TensorSlot``), a pre-existing
value (``SourceRef``), a new object (``NewRef``) or arithmetic on numbers read
from sources (``BinRef``, so that ``count += 1`` needs no guard on ``count``).
"""

from __future__ import annotations

import enum
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .sources import CellSource, GlobalSource, Source

BINARY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
    "&": operator.and_,
    "|": operator.or_,
    "^": operator.xor,
    "<<": operator.lshift,
    ">>": operator.rshift,
}


class Ref:
    """A value in a replay plan."""

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ConstRef(Ref):
    value: object

    def describe(self) -> str:
        return f"const({_stable_repr(self.value)})"


@dataclass(frozen=True, slots=True)
class TensorSlot(Ref):
    """Output ``index`` of the traced graph (user outputs first, then side-effect slots)."""

    index: int

    def describe(self) -> str:
        return f"slot({self.index})"


@dataclass(frozen=True, slots=True)
class SourceRef(Ref):
    """The value at ``source`` as it was before the hook ran."""

    source: Source

    def describe(self) -> str:
        return f"read({self.source.describe()})"


@dataclass(frozen=True, slots=True)
class NewRef(Ref):
    """The ``index``-th object in ``ReplayPlan.new_objects``."""

    index: int

    def describe(self) -> str:
        return f"new({self.index})"


@dataclass(frozen=True, slots=True)
class BinRef(Ref):
    """``lhs <op> rhs`` on numbers, evaluated at replay time."""

    op: str
    lhs: Ref
    rhs: Ref

    def describe(self) -> str:
        return f"({self.lhs.describe()} {self.op} {self.rhs.describe()})"


class NewKind(enum.Enum):
    LIST = "list"
    TUPLE = "tuple"
    DICT = "dict"
    SET = "set"


@dataclass(frozen=True, slots=True)
class NewObject:
    """A container created by the hook; dict items alternate key, value."""

    kind: NewKind
    items: tuple[Ref, ...]

    def describe(self) -> str:
        return f"{self.kind.value}({', '.join(r.describe() for r in self.items)})"


class EffectOp(enum.Enum):
    STORE_CELL = "store_cell"
    STORE_GLOBAL = "store_global"
    DELETE_GLOBAL = "delete_global"
    SET_ATTR = "set_attr"
    DEL_ATTR = "del_attr"
    LIST_APPEND = "list_append"
    LIST_INSERT = "list_insert"
    LIST_SETITEM = "list_setitem"
    LIST_DELITEM = "list_delitem"
    LIST_CLEAR = "list_clear"
    DICT_SETITEM = "dict_setitem"
    DICT_DELITEM = "dict_delitem"
    DICT_CLEAR = "dict_clear"
    SET_ADD = "set_add"
    SET_DISCARD = "set_discard"
    SET_CLEAR = "set_clear"


# Which operand each op uses: (target, key, value); STORE_CELL/GLOBAL use `root` instead of target.
_OPERANDS: dict[EffectOp, tuple[bool, bool, bool]] = {
    EffectOp.STORE_CELL: (False, False, True),
    EffectOp.STORE_GLOBAL: (False, False, True),
    EffectOp.DELETE_GLOBAL: (False, False, False),
    EffectOp.SET_ATTR: (True, True, True),
    EffectOp.DEL_ATTR: (True, True, False),
    EffectOp.LIST_APPEND: (True, False, True),
    EffectOp.LIST_INSERT: (True, True, True),
    EffectOp.LIST_SETITEM: (True, True, True),
    EffectOp.LIST_DELITEM: (True, True, False),
    EffectOp.LIST_CLEAR: (True, False, False),
    EffectOp.DICT_SETITEM: (True, True, True),
    EffectOp.DICT_DELITEM: (True, True, False),
    EffectOp.DICT_CLEAR: (True, False, False),
    EffectOp.SET_ADD: (True, False, True),
    EffectOp.SET_DISCARD: (True, False, True),
    EffectOp.SET_CLEAR: (True, False, False),
}


@dataclass(frozen=True, slots=True)
class Effect:
    """One mutation of a pre-existing object (or cell, or global), applied in order."""

    op: EffectOp
    target: Ref | None = None
    key: Ref | None = None
    value: Ref | None = None
    root: Source | None = None
    where: str = ""

    def describe(self) -> str:
        parts = [self.op.value]
        for ref in (self.target, self.key, self.value):
            if ref is not None:
                parts.append(ref.describe())
        if self.root is not None:
            parts.append(self.root.describe())
        return " ".join(parts)


class ReplayPlanError(ValueError):
    """A replay plan that does not satisfy its invariants (see ``ReplayPlan.check``)."""


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Reads, new objects and ordered effects of one traced hook, plus its return value."""

    reads: tuple[Source, ...]
    new_objects: tuple[NewObject, ...]
    effects: tuple[Effect, ...]
    output: Ref
    num_slots: int

    def check(self) -> None:
        """Verify every reference points at something that exists when it is evaluated."""
        reads = {s.describe() for s in self.reads}

        def check_ref(ref: Ref | None, new_limit: int, what: str) -> None:
            if ref is None:
                return
            if isinstance(ref, TensorSlot):
                if not 0 <= ref.index < self.num_slots:
                    raise ReplayPlanError(
                        f"{what}: slot {ref.index} outside 0..{self.num_slots - 1}"
                    )
            elif isinstance(ref, NewRef):
                if not 0 <= ref.index < new_limit:
                    raise ReplayPlanError(f"{what}: new({ref.index}) used before it is built")
            elif isinstance(ref, SourceRef):
                if ref.source.describe() not in reads:
                    raise ReplayPlanError(f"{what}: {ref.source.describe()} is not in reads")
            elif isinstance(ref, BinRef):
                if ref.op not in BINARY_OPS:
                    raise ReplayPlanError(f"{what}: unknown operator {ref.op!r}")
                check_ref(ref.lhs, new_limit, what)
                check_ref(ref.rhs, new_limit, what)
            elif not isinstance(ref, ConstRef):
                raise ReplayPlanError(f"{what}: unknown reference {ref!r}")

        for i, obj in enumerate(self.new_objects):
            if obj.kind is NewKind.DICT and len(obj.items) % 2:
                raise ReplayPlanError(f"new({i}): dict with an odd number of items")
            for ref in obj.items:
                check_ref(ref, i, f"new({i})")
        n = len(self.new_objects)
        for i, eff in enumerate(self.effects):
            uses = _OPERANDS[eff.op]
            for used, operand, name in zip(
                uses, (eff.target, eff.key, eff.value), ("target", "key", "value"), strict=True
            ):
                if used != (operand is not None):
                    raise ReplayPlanError(
                        f"effect {i} ({eff.op.value}): {name} {'missing' if used else 'unexpected'}"
                    )
                check_ref(operand, n, f"effect {i}")
            needs_root = eff.op in (
                EffectOp.STORE_CELL,
                EffectOp.STORE_GLOBAL,
                EffectOp.DELETE_GLOBAL,
            )
            if needs_root != (eff.root is not None):
                raise ReplayPlanError(
                    f"effect {i} ({eff.op.value}): root {'missing' if needs_root else 'unexpected'}"
                )
            if eff.op is EffectOp.STORE_CELL and not isinstance(eff.root, CellSource):
                raise ReplayPlanError(f"effect {i}: store_cell needs a cell root")
            if eff.op in (EffectOp.STORE_GLOBAL, EffectOp.DELETE_GLOBAL) and not isinstance(
                eff.root, GlobalSource
            ):
                raise ReplayPlanError(f"effect {i}: {eff.op.value} needs a global root")
        check_ref(self.output, n, "output")

    def describe(self) -> str:
        lines = [f"reads: {', '.join(s.describe() for s in self.reads)}"]
        lines += [f"new({i}) = {o.describe()}" for i, o in enumerate(self.new_objects)]
        lines += [e.describe() for e in self.effects]
        lines.append(f"return {self.output.describe()}")
        return "\n".join(lines)

    def apply(self, outputs: Sequence[Any], args: Sequence[Any]) -> Any:
        """Apply the plan after the graph ran with ``outputs``; return the hook's return value."""
        read_values = {s.describe(): s.resolve(args) for s in self.reads}
        built: list[Any] = []

        def value(ref: Ref) -> Any:
            if isinstance(ref, ConstRef):
                return ref.value
            if isinstance(ref, TensorSlot):
                return outputs[ref.index]
            if isinstance(ref, SourceRef):
                return read_values[ref.source.describe()]
            if isinstance(ref, NewRef):
                return built[ref.index]
            if isinstance(ref, BinRef):
                return BINARY_OPS[ref.op](value(ref.lhs), value(ref.rhs))
            raise ReplayPlanError(f"unknown reference {ref!r}")

        for obj in self.new_objects:
            items = [value(r) for r in obj.items]
            if obj.kind is NewKind.LIST:
                built.append(items)
            elif obj.kind is NewKind.TUPLE:
                built.append(tuple(items))
            elif obj.kind is NewKind.SET:
                built.append(set(items))
            else:
                built.append(dict(zip(items[::2], items[1::2], strict=True)))
        for eff in self.effects:
            _apply_effect(eff, value)
        return value(self.output)


def _apply_effect(eff: Effect, value: Callable[[Ref], Any]) -> None:
    op = eff.op
    target: Any = value(eff.target) if eff.target is not None else None
    key: Any = value(eff.key) if eff.key is not None else None
    val: Any = value(eff.value) if eff.value is not None else None
    if op is EffectOp.STORE_CELL:
        assert isinstance(eff.root, CellSource)
        eff.root.cell.cell_contents = val
    elif op is EffectOp.STORE_GLOBAL:
        assert isinstance(eff.root, GlobalSource)
        eff.root.namespace[eff.root.name] = val
    elif op is EffectOp.DELETE_GLOBAL:
        assert isinstance(eff.root, GlobalSource)
        del eff.root.namespace[eff.root.name]
    elif op is EffectOp.SET_ATTR:
        object.__setattr__(target, key, val)
    elif op is EffectOp.DEL_ATTR:
        object.__delattr__(target, key)
    elif op is EffectOp.LIST_APPEND:
        list.append(target, val)
    elif op is EffectOp.LIST_INSERT:
        list.insert(target, key, val)
    elif op is EffectOp.LIST_SETITEM:
        list.__setitem__(target, key, val)
    elif op is EffectOp.LIST_DELITEM:
        list.__delitem__(target, key)
    elif op is EffectOp.LIST_CLEAR:
        list.clear(target)
    elif op is EffectOp.DICT_SETITEM:
        dict.__setitem__(target, key, val)
    elif op is EffectOp.DICT_DELITEM:
        dict.__delitem__(target, key)
    elif op is EffectOp.DICT_CLEAR:
        dict.clear(target)
    elif op is EffectOp.SET_ADD:
        set.add(target, val)
    elif op is EffectOp.SET_DISCARD:
        set.discard(target, val)
    elif op is EffectOp.SET_CLEAR:
        set.clear(target)


def _stable_repr(value: object) -> str:
    """repr without addresses or hash-seed-dependent ordering."""
    if isinstance(value, (frozenset, set)):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_stable_repr(v) for v in value) + ",)"
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, types.ModuleType):
        return f"<module {value.__name__}>"
    if callable(value) and not isinstance(value, (int, float, complex, str)):
        return f"<callable {getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}>"
    if isinstance(value, BaseException):
        return f"{type(value).__qualname__}{_stable_repr(value.args)}"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_stable_repr(v) for v in value) + "]"
    return repr(value)
