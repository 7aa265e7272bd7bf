"""Guards compiled into one check function over a hook's roots."""

from __future__ import annotations

import math
import types
from typing import Any

import pytest

from loom_sidefx import (
    ArgSource,
    AttrSource,
    CellContentsSource,
    ClosureSource,
    FunctionClosureSource,
    GlobalSource,
    Guard,
    GuardKind,
    ItemSource,
    ObjectSource,
    Roots,
    compile_guards,
    constant_guard,
)


class Box:
    def __init__(self) -> None:
        self.items = [1, 2]


def roots(**globals_: Any) -> Roots:
    return Roots((Box(),), dict(globals_), (types.CellType(3),))


def test_each_guard_kind_passes_on_matching_state_and_fails_otherwise() -> None:
    sentinel = object()
    guards = [
        Guard(GuardKind.EQUALS, GlobalSource("n"), 2),
        Guard(GuardKind.IDENTITY, GlobalSource("obj"), sentinel),
        Guard(GuardKind.TYPE, ArgSource(0), Box),
        Guard(GuardKind.LENGTH, AttrSource(ArgSource(0), "items"), 2),
        Guard(GuardKind.EQUALS, CellContentsSource(ClosureSource(0, "k")), 3),
    ]
    check = compile_guards(guards)
    assert check(roots(n=2, obj=sentinel))
    assert not check(roots(n=3, obj=sentinel))
    assert not check(roots(n=2, obj=object()))
    assert not check(roots(n=2.0, obj=sentinel)), "2.0 == 2 but is another constant"
    assert not check(roots(n=True, obj=sentinel))
    r = roots(n=2, obj=sentinel)
    r.args[0].items.append(3)
    assert not check(r)


def test_bool_and_int_constants_are_distinguished() -> None:
    check = compile_guards([Guard(GuardKind.EQUALS, GlobalSource("flag"), 1)])
    assert check(roots(flag=1))
    assert not check(roots(flag=True))
    check_true = compile_guards([Guard(GuardKind.EQUALS, GlobalSource("flag"), True)])
    assert check_true(roots(flag=True)) and not check_true(roots(flag=1))


def test_tuple_float_and_nan_constants() -> None:
    check = compile_guards(
        [
            Guard(GuardKind.EQUALS, GlobalSource("t"), (1, "a", None)),
            Guard(GuardKind.EQUALS, GlobalSource("x"), math.nan),
        ]
    )
    assert check(roots(t=(1, "a", None), x=math.nan))
    assert not check(roots(t=(1, "a", 0), x=math.nan))
    assert not check(roots(t=(True, "a", None), x=math.nan))
    assert not check(roots(t=(1, "a", None), x=0.0))


def test_a_missing_global_or_empty_cell_fails_instead_of_raising() -> None:
    check = compile_guards([Guard(GuardKind.EQUALS, GlobalSource("missing"), 1)])
    assert not check(roots())
    cell_check = compile_guards(
        [Guard(GuardKind.EQUALS, CellContentsSource(ClosureSource(0, "k")), 3)]
    )
    assert not cell_check(Roots((), {}, (types.CellType(),)))


def test_nested_sources_compile() -> None:
    def helper() -> int:
        return secret

    secret = 41
    g = {"helper": helper, "table": {"k": [10]}}
    guards = [
        Guard(
            GuardKind.EQUALS,
            CellContentsSource(FunctionClosureSource(GlobalSource("helper"), 0, "secret")),
            41,
        ),
        Guard(GuardKind.EQUALS, ItemSource(ItemSource(GlobalSource("table"), "k"), 0), 10),
    ]
    assert compile_guards(guards)(Roots((), g))
    secret = 42
    assert not compile_guards(guards)(Roots((), g))


def test_duplicate_guards_are_checked_once_and_text_is_deterministic() -> None:
    a = constant_guard(GlobalSource("n"), 2)
    b = constant_guard(GlobalSource("n"), 2)
    assert a == b and hash(a) == hash(b)
    check = compile_guards([a, b, constant_guard(GlobalSource("o"), Box())])
    assert check.__doc__ is not None
    assert check.__doc__.splitlines() == [
        "G['n'] == 2",
        "G['n'] == 2",
        f"G['o'] is <{Box.__module__}.Box object>",
    ]


def test_constant_guard_picks_equality_for_constants_and_identity_otherwise() -> None:
    assert constant_guard(GlobalSource("x"), 3).kind is GuardKind.EQUALS
    assert constant_guard(GlobalSource("x"), [3]).kind is GuardKind.IDENTITY


def test_malformed_guards_are_rejected_at_construction() -> None:
    with pytest.raises(TypeError):
        Guard(GuardKind.EQUALS, GlobalSource("x"), [1])
    with pytest.raises(TypeError):
        Guard(GuardKind.LENGTH, GlobalSource("x"), "3")


def test_empty_guard_list_always_passes() -> None:
    assert compile_guards([])(roots())


class Positive:
    def __call__(self, value: Any) -> bool:
        return bool(value > 0)

    def describe(self) -> str:
        return "positive"


def test_absent_same_as_dict_keys_and_predicate_guards() -> None:
    shared: list[int] = []
    guards = [
        Guard(GuardKind.ABSENT, GlobalSource("later"), None),
        Guard(GuardKind.ABSENT, ItemSource(GlobalSource("table"), "b"), None),
        Guard(GuardKind.ABSENT, AttrSource(ArgSource(0), "missing"), None),
        Guard(GuardKind.SAME_AS, GlobalSource("a"), GlobalSource("b")),
        Guard(GuardKind.DICT_KEYS, GlobalSource("table"), ("a",)),
        Guard(GuardKind.PREDICATE, GlobalSource("n"), Positive()),
    ]
    check = compile_guards(guards)
    good = {"table": {"a": 1}, "a": shared, "b": shared, "n": 3}
    assert check(Roots((Box(),), dict(good)))
    assert not check(Roots((Box(),), dict(good, later=1)))
    assert not check(Roots((Box(),), dict(good, table={"a": 1, "b": 2})))
    assert not check(Roots((Box(),), dict(good, b=[])))
    assert not check(Roots((Box(),), dict(good, n=-1)))
    assert [g.describe() for g in guards] == [
        "absent(G['later'])",
        "absent(G['table']['b'])",
        "absent(args[0].missing)",
        "G['a'] is G['b']",
        "keys(G['table']) == ('a',)",
        "positive(G['n'])",
    ]


def test_object_sources_hold_their_root_by_identity() -> None:
    namespace = {"x": 1}
    src = ItemSource(ObjectSource(namespace, "globals:other"), "x")
    assert src.describe() == "globals:other['x']"
    check = compile_guards([Guard(GuardKind.EQUALS, src, 1)])
    assert check(roots())
    namespace["x"] = 2
    assert not check(roots())
    assert ObjectSource(namespace, "l") == ObjectSource(namespace, "l")
    assert ObjectSource(namespace, "l") != ObjectSource({"x": 2}, "l")


def test_present_guard_is_the_dual_of_absent() -> None:
    check = compile_guards(
        [
            Guard(GuardKind.PRESENT, GlobalSource("x"), None),
            Guard(GuardKind.PRESENT, ItemSource(GlobalSource("d"), "k"), None),
            Guard(GuardKind.PRESENT, AttrSource(ArgSource(0), "items"), None),
        ]
    )
    assert check(roots(x=1, d={"k": 0}))
    assert not check(roots(d={"k": 0}))
    assert not check(roots(x=1, d={}))


def test_distinct_from_guard_fails_when_two_sources_alias() -> None:
    guard = Guard(GuardKind.DISTINCT_FROM, GlobalSource("a"), GlobalSource("b"))
    check = compile_guards([guard])
    assert check(Roots((), {"a": [], "b": []}))
    shared: list[int] = []
    assert not check(Roots((), {"a": shared, "b": shared}))
    assert guard.describe() == "G['a'] is not G['b']"


class _Atom:
    """An immutable atom compared by value (like torch.dtype)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Atom) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"atom.{self.name}"


def test_a_registered_constant_type_is_recorded_keyed_and_guarded_by_value() -> None:
    from loom_sidefx import SideEffects, is_constant, register_constant_type

    assert not is_constant(_Atom("a"))
    register_constant_type(_Atom)
    assert is_constant(_Atom("a")) and is_constant((_Atom("a"), 1))
    seen: set[object] = set()
    se = SideEffects()
    se.set_add(se.track_existing(seen, GlobalSource("seen")), _Atom("f32"))
    se.build().apply(Roots((), {"seen": seen}))
    assert seen == {_Atom("f32")}
    check = compile_guards([Guard(GuardKind.EQUALS, GlobalSource("d"), _Atom("f32"))])
    assert check(Roots((), {"d": _Atom("f32")}))
    assert not check(Roots((), {"d": _Atom("bf16")}))
