"""Guards: sourced checks that a trace's assumptions still hold on a new call.

A :class:`Guard` says "the object at ``source`` is ``expected``" (identity), "equals
the constant ``expected``" (same exact type and value), "has exactly type
``expected``", or "has length ``expected``". :func:`compile_guards` turns a tuple
of guards into ONE generated Python function over :class:`~loom_sidefx.Roots`
that evaluates each distinct source path once; any exception while evaluating
(a missing global, an empty cell) means the guards fail. Invariant: guard text is
deterministic and never shows an address.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._codegen import Emitter
from ._ops import describe_type
from ._sources import AttrSource, GlobalSource, ItemSource, Roots, Source
from ._values import is_constant

__all__ = [
    "Guard",
    "GuardKind",
    "GuardPredicate",
    "SameElements",
    "compile_guards",
    "constant_guard",
]


class GuardKind(enum.Enum):
    """What a guard checks about the object at its source."""

    #: ``value is expected`` (the guard keeps ``expected`` alive).
    IDENTITY = "identity"
    #: ``type(value) is type(expected) and value == expected`` for a constant.
    EQUALS = "equals"
    #: ``type(value) is expected``.
    TYPE = "type"
    #: ``len(value) == expected``.
    LENGTH = "length"
    #: The last step of the source does not resolve: the global, dict key or
    #: attribute is absent (``expected`` is None).
    ABSENT = "absent"
    #: The last step of the source resolves: the global, dict key or attribute
    #: is present (``expected`` is None).
    PRESENT = "present"
    #: ``value is`` the object at another source (``expected`` is that Source).
    SAME_AS = "same_as"
    #: ``value is not`` the object at another source (``expected`` is that
    #: Source): two objects a trace modelled as distinct must not alias.
    DISTINCT_FROM = "distinct_from"
    #: ``tuple(value) == expected``: a dict's keys, in order (constants).
    DICT_KEYS = "dict_keys"
    #: ``expected(value)`` is true, for a :class:`GuardPredicate` supplied by the
    #: caller (e.g. tensor metadata checks by a torch-aware tracer).
    PREDICATE = "predicate"


@runtime_checkable
class GuardPredicate(Protocol):
    """A caller-defined check on one value, with deterministic text."""

    def __call__(self, value: Any) -> bool: ...

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Guard:
    """One sourced check; see :class:`GuardKind`."""

    kind: GuardKind
    source: Source
    expected: Any = dataclasses.field(compare=False)

    def __post_init__(self) -> None:
        if self.kind is GuardKind.EQUALS and not is_constant(self.expected):
            raise TypeError(
                f"EQUALS guard needs a constant, got {type(self.expected).__qualname__}"
            )
        if self.kind is GuardKind.TYPE and not isinstance(self.expected, type):
            raise TypeError("TYPE guard needs a class")
        if self.kind is GuardKind.LENGTH and type(self.expected) is not int:
            raise TypeError("LENGTH guard needs an int")
        if self.kind in (GuardKind.ABSENT, GuardKind.PRESENT) and not isinstance(
            self.source, GlobalSource | ItemSource | AttrSource
        ):
            raise TypeError(f"{self.kind.name} guard needs a global, item or attribute source")
        if self.kind in (GuardKind.SAME_AS, GuardKind.DISTINCT_FROM) and not isinstance(
            self.expected, Source
        ):
            raise TypeError(f"{self.kind.name} guard needs a Source")
        if self.kind is GuardKind.DICT_KEYS and not (
            type(self.expected) is tuple and is_constant(self.expected)
        ):
            raise TypeError("DICT_KEYS guard needs a tuple of constant keys")
        if self.kind is GuardKind.PREDICATE and not isinstance(self.expected, GuardPredicate):
            raise TypeError("PREDICATE guard needs a GuardPredicate (callable with describe())")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Guard):
            return NotImplemented
        if self.kind is not other.kind or self.source != other.source:
            return False
        if self.kind in (GuardKind.EQUALS, GuardKind.DICT_KEYS):
            return _same_constant(self.expected, other.expected)
        if self.kind in (GuardKind.SAME_AS, GuardKind.DISTINCT_FROM):
            return bool(self.expected == other.expected)
        return bool(self.expected is other.expected)

    def __hash__(self) -> int:
        return hash((self.kind, self.source))

    def check(self, roots: Roots) -> bool:
        """Evaluate this guard alone (slow path; use :func:`compile_guards`)."""
        return compile_guards((self,))(roots)

    def describe(self) -> str:
        """Deterministic text, e.g. ``closure[0:count].cell_contents == 3``."""
        src = self.source.describe()
        if self.kind is GuardKind.IDENTITY:
            return f"{src} is <{describe_type(type(self.expected))} object>"
        if self.kind is GuardKind.EQUALS:
            return f"{src} == {self.expected!r}"
        if self.kind is GuardKind.TYPE:
            return f"type({src}) is {describe_type(self.expected)}"
        if self.kind is GuardKind.LENGTH:
            return f"len({src}) == {self.expected}"
        if self.kind is GuardKind.ABSENT:
            return f"absent({src})"
        if self.kind is GuardKind.PRESENT:
            return f"present({src})"
        if self.kind is GuardKind.SAME_AS:
            return f"{src} is {self.expected.describe()}"
        if self.kind is GuardKind.DISTINCT_FROM:
            return f"{src} is not {self.expected.describe()}"
        if self.kind is GuardKind.DICT_KEYS:
            return f"keys({src}) == {self.expected!r}"
        return f"{self.expected.describe()}({src})"


def constant_guard(source: Source, value: Any) -> Guard:
    """The natural guard on a read value: EQUALS for a constant, IDENTITY otherwise."""
    kind = GuardKind.EQUALS if is_constant(value) else GuardKind.IDENTITY
    return Guard(kind, source, value)


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(_same_constant(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float and a != a:
        return bool(b != b)
    return bool(a == b)


def compile_guards(guards: Sequence[Guard]) -> Callable[[Roots], bool]:
    """Compile guards into one function ``check(roots) -> bool``.

    Each distinct source path is evaluated once; the checks run in order and
    stop at the first failure; any exception means False. Build it once per
    trace, call it per call. ``check.__doc__`` lists the guards' text.
    """
    em = Emitter("        ")
    em.namespace["_same"] = _same_constant
    for guard in dict.fromkeys(guards):
        if guard.kind in (GuardKind.ABSENT, GuardKind.PRESENT):
            cond = _present(guard.source, em)
            em.emit(f"if {cond}:" if guard.kind is GuardKind.ABSENT else f"if not ({cond}):")
            em.emit("    return False")
            continue
        v = em.source(guard.source)
        e = guard.expected
        if guard.kind is GuardKind.SAME_AS:
            cond = f"{v} is {em.source(e)}"
        elif guard.kind is GuardKind.DISTINCT_FROM:
            cond = f"{v} is not {em.source(e)}"
        elif guard.kind is GuardKind.DICT_KEYS:
            cond = f"tuple({v}) == {em.const(e)}"
        elif guard.kind is GuardKind.PREDICATE:
            cond = f"{em.const(e)}({v})"
        elif guard.kind is GuardKind.IDENTITY:
            cond = f"{v} is {em.const(e)}"
        elif guard.kind is GuardKind.TYPE:
            cond = f"type({v}) is {em.const(e)}"
        elif guard.kind is GuardKind.LENGTH:
            cond = f"len({v}) == {e}"
        elif e is None or type(e) is bool:
            cond = f"{v} is {e!r}"
        elif type(e) in (int, str, bytes):
            cond = f"type({v}) is {em.const(type(e))} and {v} == {em.const(e)}"
        else:
            cond = f"_same({v}, {em.const(e)})"
        em.emit(f"if not ({cond}):")
        em.emit("    return False")
    if not em.lines:
        em.emit("pass")
    header = [
        "def check(roots):",
        "    a = roots.args",
        "    g = roots.globals",
        "    c = roots.closure",
        "    try:",
    ]
    footer = ["    except Exception:", "        return False", "    return True"]
    check: Callable[[Roots], bool] = em.function("check", header, footer, "<loom guards>")
    check.__doc__ = "\n".join(g.describe() for g in guards)
    return check


def _present(src: Source, em: Emitter) -> str:
    """An expression that is true when the source's last step resolves."""
    if isinstance(src, GlobalSource):
        return f"{em.const(src.name)} in g"
    if isinstance(src, ItemSource):
        return f"{em.const(src.key)} in {em.source(src.base)}"
    assert isinstance(src, AttrSource)
    return f"hasattr({em.source(src.base)}, {em.const(src.name)})"


@dataclasses.dataclass(frozen=True, slots=True)
class SameElements:
    """A :class:`GuardPredicate`: the set at the source holds exactly these constants."""

    elements: frozenset[Any]

    def __call__(self, value: Any) -> bool:
        return isinstance(value, set | frozenset) and value == self.elements

    def describe(self) -> str:
        return "same_elements{" + ", ".join(sorted(repr(e) for e in self.elements)) + "}"
