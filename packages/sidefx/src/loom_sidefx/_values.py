"""Symbolic values of the side-effect log and their mutation type.

A value recorded by the log is one of: a constant (``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``...``, or a tuple/frozenset of
constants), a :class:`Ref` to a tracked object, a :class:`TensorSlot` (an extra
output of the graph), an :class:`Original` (an unmodified item of a pre-existing
object, reached through its source), a :class:`Computed` (arithmetic evaluated
at replay time), or a plain ``tuple`` of values. Invariant:
values are immutable and never carry ``id()``; tracked objects are referred to
by their :class:`Ref`, whose identity is the order in which they were tracked.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Callable
from typing import Any, TypeAlias

from ._sources import Source

__all__ = [
    "COMPUTE_OPS",
    "Computed",
    "Missing",
    "MutationType",
    "ObjKind",
    "Original",
    "Ref",
    "Staged",
    "TensorSlot",
    "Value",
    "concrete",
    "is_constant",
    "register_constant_type",
]

#: A recorded value: a constant, Ref, TensorSlot, Original, Computed, or a tuple of values.
Value: TypeAlias = Any

_CONSTANT_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, type(Ellipsis)}
)


#: Immutable, hashable types a caller declared constant (see register_constant_type).
_REGISTERED_CONSTANT_TYPES: set[type] = set()


def register_constant_type(cls: type) -> None:
    """Declare instances of ``cls`` (exact type) immutable, hashable constants.

    For a caller's atoms that have a deterministic ``repr`` and compare by
    value, such as ``torch.dtype`` or ``torch.device``: they are then recorded,
    used as keys and guarded (EQUALS) like builtin constants. Registration is
    process-wide and cannot be undone.
    """
    if cls.__hash__ is None:
        raise TypeError(f"{cls.__qualname__} is not hashable")
    _REGISTERED_CONSTANT_TYPES.add(cls)


def is_constant(value: object) -> bool:
    """True for immutable constants replayed by value (exact builtin types, or registered)."""
    t = type(value)
    if t in _CONSTANT_TYPES or t in _REGISTERED_CONSTANT_TYPES:
        return True
    if t is tuple or t is frozenset:
        return all(is_constant(v) for v in value)  # type: ignore[attr-defined]
    return False


class MutationType(enum.Enum):
    """Whether a tracked object existed before the hook ran or was created by it."""

    #: Created during the trace: replayed only if it escapes into pre-existing state.
    NEW = "new"
    #: Existed before the trace: reached through a source, mutations are replayed.
    PREEXISTING = "preexisting"


class ObjKind(enum.Enum):
    """How the log models a tracked object (subclasses keep their base's kind)."""

    LIST = "list"
    DICT = "dict"
    SET = "set"
    CELL = "cell"
    FUNCTION = "function"
    OBJECT = "object"


class Missing(enum.Enum):
    """What a symbolic read returns when the log holds no value."""

    #: The trace did not write it: read the live object (pre-existing) or the
    #: class (new object).
    UNCHANGED = "unchanged"
    #: Absent now: deleted during the trace, never set on a new object, a
    #: missing dict key, or an empty cell. An attribute read then falls back to
    #: the class; any other read raises.
    ABSENT = "absent"


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A handle to an object tracked by one :class:`~loom_sidefx.SideEffects` builder.

    ``index`` is the tracking order (deterministic for a deterministic trace).
    """

    index: int
    mutation: MutationType
    kind: ObjKind

    @property
    def is_new(self) -> bool:
        return self.mutation is MutationType.NEW


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSlot:
    """Placeholder for the graph's extra output number ``index``."""

    index: int

    def describe(self) -> str:
        return f"t{self.index}"


@dataclasses.dataclass(frozen=True, slots=True)
class Original:
    """An item of a pre-existing object as it was before the hook ran.

    Replay reaches it through ``source``, evaluated before any mutation is
    applied. ``obj`` is the live object seen while tracing (for the tracer to
    inspect and guard on); it takes no part in equality. Constants read from
    pre-existing state are Originals too, so storing them elsewhere or using
    them in a :class:`Computed` needs no guard; :func:`concrete` gives the
    trace-time value when the tracer specializes on it.
    """

    source: Source | None
    obj: Any = dataclasses.field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return self.source.describe() if self.source is not None else "<original without source>"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Staged:
    """A tracer's own symbolic value held in the log's symbolic state.

    A tracer stores what it has (a tensor node, say) and reads it back as it
    stored it; ``SideEffects.build(resolve=...)`` turns the staged values that
    reach the replay plan (op arguments, results, contents of new objects that
    escape) into recorded values, in program order. Compared by identity.
    """

    payload: Any


def concrete(value: Value) -> Any:
    """The trace-time object behind a value: ``Original.obj`` (recursively in tuples).

    Using it specializes the trace on that object: guard its source.
    """
    if isinstance(value, Original):
        return value.obj
    if type(value) is tuple:
        return tuple(concrete(v) for v in value)
    return value


#: Binary operators a :class:`Computed` value may apply.
COMPUTE_OPS: dict[str, Callable[[Any, Any], Any]] = {
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
    "min": min,
    "max": max,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Computed:
    """``lhs <op> rhs`` evaluated at replay time.

    Lets ``count += 1`` on a pre-existing int be replayed as
    ``Computed("+", Original(count_source), 1)`` with no guard on ``count``, as
    long as the trace never branches on it. Operands are values.
    """

    op: str
    lhs: Value
    rhs: Value

    def __post_init__(self) -> None:
        if self.op not in COMPUTE_OPS:
            raise ValueError(
                f"unknown Computed operator {self.op!r} (known: {sorted(COMPUTE_OPS)})"
            )
