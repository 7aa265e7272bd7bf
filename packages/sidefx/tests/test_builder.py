"""Recording side effects: tracked objects, symbolic views, typed refusals."""

from __future__ import annotations

import types
from typing import Any

import pytest

from loom_sidefx import (
    ArgSource,
    GlobalSource,
    ItemSource,
    Missing,
    MutationType,
    ObjKind,
    Original,
    Roots,
    SideEffectRefusalKind,
    SideEffectRefused,
    SideEffects,
    Staged,
    TensorSlot,
    compile_guards,
    concrete,
)


class Plain:
    def __init__(self) -> None:
        self.a = 1


class WithProperty:
    @property
    def p(self) -> int:
        return 1

    @p.setter
    def p(self, value: int) -> None:
        raise AssertionError("user code must not run")


class Slotted:
    __slots__ = ("x",)


def refusal(fn: Any, *args: Any) -> SideEffectRefusalKind:
    with pytest.raises(SideEffectRefused) as info:
        fn(*args)
    return info.value.reason.kind


def test_tracking_the_same_object_twice_returns_one_ref() -> None:
    xs: list[int] = []
    se = SideEffects()
    a = se.track_existing(xs, GlobalSource("xs"))
    b = se.track_existing(xs, ItemSource(GlobalSource("holder"), 0))
    assert a == b and a.mutation is MutationType.PREEXISTING and a.kind is ObjKind.LIST
    assert se.source_of(a) == GlobalSource("xs"), "the first source wins"
    assert se.tracked(xs) == a and se.tracked([]) is None


def test_subclasses_keep_their_base_kind() -> None:
    class L(list[int]):
        pass

    class D(dict[str, int]):
        pass

    se = SideEffects()
    assert se.track_existing(L(), None).kind is ObjKind.LIST
    assert se.track_existing(D(), None).kind is ObjKind.DICT
    assert se.track_existing({1}, None).kind is ObjKind.SET
    assert se.track_existing(Plain(), None).kind is ObjKind.OBJECT


def test_views_show_mutations_made_earlier_in_the_same_trace() -> None:
    inner = [0]
    xs = [1, inner, "s"]
    se = SideEffects()
    ref = se.track_existing(xs, GlobalSource("xs"))
    slot = se.new_tensor_slot()
    se.list_append(ref, slot)
    items = se.list_items(ref)
    assert items[0] == Original(ItemSource(GlobalSource("xs"), 0))
    assert concrete(items) == (1, inner, "s", TensorSlot(0))
    assert items[1] == Original(ItemSource(GlobalSource("xs"), 1))
    assert items[1].obj is inner
    assert xs == [1, inner, "s"], "the live list is untouched while tracing"


def test_an_original_item_that_is_tracked_is_viewed_as_its_ref() -> None:
    inner: list[int] = []
    outer = [inner]
    se = SideEffects()
    o = se.track_existing(outer, GlobalSource("outer"))
    i = se.track_existing(inner, ItemSource(GlobalSource("outer"), 0))
    assert se.list_items(o) == (i,)


def test_pop_returns_the_symbolic_value() -> None:
    se = SideEffects()
    ref = se.track_existing([1, 2], GlobalSource("xs"))
    assert concrete(se.list_pop(ref)) == 2
    assert concrete(se.list_pop(ref, 0)) == 1
    assert refusal(se.list_pop, ref) is SideEffectRefusalKind.WOULD_RAISE


def test_dict_views_follow_setitem_pop_and_setdefault() -> None:
    d = {"a": 1, "b": [2]}
    se = SideEffects()
    ref = se.track_existing(d, ArgSource(0))
    se.dict_setitem(ref, "c", 3)
    assert concrete(se.dict_pop(ref, "a")) == 1
    assert se.dict_pop(ref, "zz", None) is None
    assert se.dict_setdefault(ref, "c", 9) == 3
    assert se.dict_setdefault(ref, "d", 4) == 4
    assert [k for k, _ in se.dict_items(ref)] == ["b", "c", "d"]
    assert se.dict_lookup(ref, "a") is Missing.ABSENT
    assert refusal(se.dict_delitem, ref, "a") is SideEffectRefusalKind.WOULD_RAISE


def test_true_and_one_are_the_same_dict_key_as_in_cpython() -> None:
    se = SideEffects()
    ref = se.track_new(ObjKind.DICT)
    se.dict_setitem(ref, 1, "int")
    se.dict_setitem(ref, True, "bool")
    real: dict[Any, str] = {}
    real[1] = "int"
    real[True] = "bool"
    assert se.dict_items(ref) == tuple(real.items())


def test_attribute_views_distinguish_unchanged_absent_and_stored() -> None:
    obj = Plain()
    se = SideEffects()
    ref = se.track_existing(obj, ArgSource(0))
    assert se.load_attr(ref, "a") is Missing.UNCHANGED
    se.store_attr(ref, "b", 2)
    se.del_attr(ref, "a")
    assert se.load_attr(ref, "b") == 2
    assert se.load_attr(ref, "a") is Missing.ABSENT
    assert refusal(se.del_attr, ref, "a") is SideEffectRefusalKind.WOULD_RAISE
    new = se.track_new(ObjKind.OBJECT, cls=Plain)
    assert se.load_attr(new, "a") is Missing.ABSENT, "a new object has no attribute until stored"


def test_globals_view_follows_stores_and_deletes() -> None:
    se = SideEffects()
    assert se.load_global("x") is Missing.UNCHANGED
    se.store_global("x", 1)
    assert se.load_global("x") == 1
    se.del_global("x")
    assert se.load_global("x") is Missing.ABSENT
    assert refusal(se.del_global, "x") is SideEffectRefusalKind.WOULD_RAISE


def test_mutating_an_object_without_a_source_is_refused() -> None:
    se = SideEffects()
    ref = se.track_existing([], None)
    assert refusal(se.list_append, ref, 1) is SideEffectRefusalKind.NO_SOURCE
    obj = se.track_existing(Plain(), None)
    assert refusal(se.store_attr, obj, "a", 2) is SideEffectRefusalKind.NO_SOURCE


def test_storing_a_sourceless_object_into_preexisting_state_is_refused_at_build() -> None:
    se = SideEffects()
    xs = se.track_existing([], GlobalSource("xs"))
    se.list_append(xs, se.track_existing(Plain(), None))
    assert refusal(se.build) is SideEffectRefusalKind.NO_SOURCE


def test_unhashable_or_object_keys_are_refused() -> None:
    se = SideEffects()
    d = se.track_existing({}, GlobalSource("d"))
    assert refusal(se.dict_setitem, d, Plain(), 1) is SideEffectRefusalKind.UNSUPPORTED_KEY
    assert (
        refusal(se.set_add, se.track_new(ObjKind.SET), (1, [2]))
        is SideEffectRefusalKind.UNSUPPORTED_KEY
    )
    weird = se.track_existing({Plain(): 1}, GlobalSource("w"))
    assert refusal(se.dict_items, weird) is SideEffectRefusalKind.UNSUPPORTED_KEY


def test_untracked_values_are_refused() -> None:
    se = SideEffects()
    xs = se.track_existing([], GlobalSource("xs"))
    assert refusal(se.list_append, xs, Plain()) is SideEffectRefusalKind.UNSUPPORTED_VALUE
    assert refusal(se.list_append, xs, [1]) is SideEffectRefusalKind.UNSUPPORTED_VALUE


def test_operations_on_the_wrong_kind_are_refused() -> None:
    se = SideEffects()
    d = se.track_existing({}, GlobalSource("d"))
    assert refusal(se.list_append, d, 1) is SideEffectRefusalKind.WRONG_KIND
    cell = se.track_existing(types.CellType(1), GlobalSource("c"))
    assert refusal(se.store_attr, cell, "x", 1) is SideEffectRefusalKind.WRONG_KIND


def test_stores_through_descriptors_or_without_instance_dict_are_refused() -> None:
    se = SideEffects()
    p = se.track_existing(WithProperty(), ArgSource(0))
    assert refusal(se.store_attr, p, "p", 1) is SideEffectRefusalKind.DESCRIPTOR_ATTR
    s = se.track_existing(Slotted(), ArgSource(1))
    se.store_attr(s, "x", 1)
    assert refusal(se.store_attr, s, "y", 1) is SideEffectRefusalKind.DESCRIPTOR_ATTR


def test_new_objects_of_c_classes_are_refused() -> None:
    class MyError(ValueError):
        pass

    se = SideEffects()
    with pytest.raises(SideEffectRefused) as info:
        se.track_new(ObjKind.OBJECT, cls=MyError)
    assert info.value.reason.kind is SideEffectRefusalKind.UNMATERIALIZABLE
    se.track_new(ObjKind.OBJECT, cls=Plain)


def test_refs_of_another_builder_are_refused() -> None:
    other = SideEffects()
    other.track_existing([], GlobalSource("a"))
    foreign = other.track_new(ObjKind.DICT)
    se = SideEffects()
    assert refusal(se.list_items, foreign) is SideEffectRefusalKind.FOREIGN_REF


def test_refusals_carry_the_current_location() -> None:
    se = SideEffects()
    se.where = "hooks.py:12"
    xs = se.track_existing([], None)
    with pytest.raises(
        SideEffectRefused, match=r"^\[no_source\] hooks.py:12: mutation of a pre-existing list"
    ):
        se.list_append(xs, 1)


def test_rollback_forgets_what_a_speculative_trace_recorded() -> None:
    xs = [1]
    d = {"a": 1}
    se = SideEffects()
    xs_ref = se.track_existing(xs, GlobalSource("xs"))
    se.list_append(xs_ref, 2)
    cp = se.checkpoint()
    se.list_append(xs_ref, 3)
    d_ref = se.track_existing(d, GlobalSource("d"))
    se.dict_setitem(d_ref, "b", se.new_tensor_slot())
    se.store_global("g", 1)
    se.track_new(ObjKind.LIST)
    se.rollback(cp)
    assert concrete(se.list_items(xs_ref)) == (1, 2)
    assert se.tracked(d) is None
    assert se.load_global("g") is Missing.UNCHANGED
    assert se.new_tensor_slot() == TensorSlot(0)
    plan = se.build()
    assert [op.kind.value for op in plan.ops] == ["list_append"]
    again = se.track_existing(d, GlobalSource("d"))
    assert again.index == d_ref.index, "refs are handed out again from the checkpoint"


def test_appending_observes_nothing_so_a_growing_list_needs_no_guard() -> None:
    se = SideEffects()
    xs = se.track_existing([1, 2], GlobalSource("xs"))
    se.list_append(xs, 3)
    se.list_extend(xs, [4])
    se.list_insert(xs, 0, 0)
    assert se.observed_guards() == ()


def test_reading_list_items_by_position_observes_the_length() -> None:
    g: dict[str, Any] = {"xs": [1, 2]}
    se = SideEffects()
    xs = se.track_existing(g["xs"], GlobalSource("xs"))
    last = se.list_items(xs)[-1]
    se.list_append(se.track_existing([], GlobalSource("ys")), last)
    (guard,) = se.observed_guards()
    assert guard.describe() == "len(G['xs']) == 2"
    check = compile_guards(se.observed_guards())
    assert check(Roots((), g))
    g["xs"].append(3)
    assert not check(Roots((), g)), "xs[-1] would now be another item"


def test_dict_reads_observe_presence_absence_and_key_order() -> None:
    g: dict[str, Any] = {"d": {"a": 1}}
    se = SideEffects()
    d = se.track_existing(g["d"], GlobalSource("d"))
    se.dict_lookup(d, "a")
    se.dict_lookup(d, "zz")
    se.dict_setitem(d, "w", 1)
    se.dict_lookup(d, "w")  # written by the trace: nothing observed
    se.dict_pop(d, "q", None)
    se.dict_items(d)
    assert [g_.describe() for g_ in se.observed_guards()] == [
        "present(G['d']['a'])",
        "absent(G['d']['zz'])",
        "absent(G['d']['q'])",
        "keys(G['d']) == ('a',)",
    ]
    check = compile_guards(se.observed_guards())
    assert check(Roots((), g))
    assert not check(Roots((), {"d": {"a": 1, "zz": 2}}))
    assert not check(Roots((), {"d": {}}))


def test_a_cleared_dict_observes_no_keys_afterwards() -> None:
    se = SideEffects()
    d = se.track_existing({"a": 1}, GlobalSource("d"))
    se.dict_clear(d)
    assert se.dict_lookup(d, "a") is Missing.ABSENT
    assert se.observed_guards() == ()


def test_reading_a_set_observes_its_elements() -> None:
    g: dict[str, Any] = {"s": {1, "b"}}
    se = SideEffects()
    s = se.track_existing(g["s"], GlobalSource("s"))
    assert set(se.set_items(s)) == {1, "b"}
    (guard,) = se.observed_guards()
    assert guard.describe() == "same_elements{'b', 1}(G['s'])"
    check = compile_guards(se.observed_guards())
    assert check(Roots((), g)) and not check(Roots((), {"s": {1}}))


def test_staged_values_read_back_as_stored_and_resolve_results_first() -> None:
    log: list[str] = []
    se = SideEffects()
    xs = se.track_existing([], GlobalSource("xs"))
    kept = se.track_new(ObjKind.LIST, [Staged("in-new")])
    dropped = se.track_new(ObjKind.LIST, [Staged("never-escapes")])
    se.list_append(xs, Staged("appended"))
    se.list_append(xs, kept)
    assert se.list_items(xs) == (se.list_items(xs)[0], kept)
    assert se.list_items(xs)[0].payload == "appended"
    assert se.list_items(dropped)[0].payload == "never-escapes"

    def resolve(payload: str) -> object:
        log.append(payload)
        return se.new_tensor_slot()

    plan = se.build(results=(Staged("returned"),), resolve=resolve)
    # The result first (its tensor is slot 0), then op arguments in program
    # order, a new object's contents when it is first reached; a new object
    # that does not escape is never resolved.
    assert log == ["returned", "appended", "in-new"]
    assert plan.results == (TensorSlot(0),)
    g: dict[str, Any] = {"xs": []}
    plan.apply(Roots((), g), ("r", "a", "n"))
    assert g["xs"] == ["a", ["n"]]


def test_a_staged_value_without_a_resolver_is_refused() -> None:
    se = SideEffects()
    xs = se.track_existing([], GlobalSource("xs"))
    se.list_append(xs, Staged(object()))
    assert refusal(se.build) is SideEffectRefusalKind.UNSUPPORTED_VALUE
