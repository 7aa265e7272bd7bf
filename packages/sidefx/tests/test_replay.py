"""Replay plans built the way the tracer builds them, applied to live state."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from loom_sidefx import (
    ArgSource,
    AttrSource,
    GlobalSource,
    ObjKind,
    PlanCheckError,
    ReplayPlan,
    Roots,
    SideEffects,
)


class CountingList(list[Any]):
    appends = 0

    def append(self, value: Any) -> None:
        CountingList.appends += 1
        super().append(value)


class CountingDict(dict[Any, Any]):
    sets = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        CountingDict.sets += 1
        super().__setitem__(key, value)


class Stats:
    def __init__(self) -> None:
        self.calls = 0


def test_new_dict_appended_to_global_list_is_materialized_with_the_tensor_output() -> None:
    g: dict[str, Any] = {"log": []}
    se = SideEffects()
    log = se.track_existing(g["log"], GlobalSource("log"))
    entry = se.track_new(ObjKind.DICT, {"loss": se.new_tensor_slot(), "step": 3})
    se.list_append(log, entry)
    plan = se.build()
    plan.check()

    plan.apply(Roots((), g), ("T0",))
    plan.apply(Roots((), g), ("T1",))

    assert g["log"] == [{"loss": "T0", "step": 3}, {"loss": "T1", "step": 3}]
    assert g["log"][0] is not g["log"][1]


def test_new_objects_that_do_not_escape_are_pruned() -> None:
    g: dict[str, Any] = {"log": []}
    se = SideEffects()
    scratch = se.track_new(ObjKind.LIST, [1, 2])
    se.list_append(scratch, 3)
    tmp = se.track_new(ObjKind.DICT)
    se.dict_setitem(tmp, "a", scratch)
    se.list_append(se.track_existing(g["log"], GlobalSource("log")), 7)
    plan = se.build()
    assert plan.new_objects == ()
    assert plan.describe().splitlines()[1:] == ["  list.append(G['log'], 7)"]


def test_subclass_mutations_replay_through_the_base_type_methods() -> None:
    g: dict[str, Any] = {"items": CountingList(), "table": CountingDict()}
    se = SideEffects()
    items = se.track_existing(g["items"], GlobalSource("items"))
    table = se.track_existing(g["table"], GlobalSource("table"))
    se.list_append(items, 1)
    se.dict_setitem(table, "k", 2)
    plan = se.build()
    CountingList.appends = CountingDict.sets = 0

    plan.apply(Roots((), g))

    assert g["items"] == [1] and g["table"] == {"k": 2}
    assert (CountingList.appends, CountingDict.sets) == (0, 0)


def test_ops_replay_in_program_order() -> None:
    g: dict[str, Any] = {"xs": [0, 1, 2]}
    se = SideEffects()
    xs = se.track_existing(g["xs"], GlobalSource("xs"))
    se.list_insert(xs, 0, "a")
    se.list_pop(xs)
    se.list_setitem(xs, -1, "z")
    se.list_append(xs, "end")
    expected = ["a", 0, 1, 2]
    expected.pop()
    expected[-1] = "z"
    expected.append("end")
    assert se.list_items(xs)[0] == "a"

    se.build().apply(Roots((), g))

    assert g["xs"] == expected


def test_attribute_store_and_delete_on_an_argument() -> None:
    stats = Stats()
    stats.extra = 1  # type: ignore[attr-defined]
    se = SideEffects()
    ref = se.track_existing(stats, ArgSource(0))
    se.store_attr(ref, "calls", 5)
    se.del_attr(ref, "extra")
    plan = se.build()

    fresh = Stats()
    fresh.extra = 1  # type: ignore[attr-defined]
    plan.apply(Roots((fresh,), {}))

    assert fresh.calls == 5 and not hasattr(fresh, "extra")
    assert stats.calls == 0, "tracing never mutates live state"


def test_check_rejects_a_plan_whose_op_targets_an_unknown_object() -> None:
    g: dict[str, Any] = {"xs": [], "ys": []}
    se = SideEffects()
    se.list_append(se.track_existing(g["xs"], GlobalSource("xs")), 1)
    plan = se.build()
    corrupt = dataclasses.replace(plan, preexisting=())
    with pytest.raises(PlanCheckError, match="not in the plan's preexisting table"):
        corrupt.check()


def test_describe_is_deterministic_text_without_addresses() -> None:
    def build() -> ReplayPlan:
        g: dict[str, Any] = {"stats": Stats()}
        se = SideEffects()
        s = se.track_existing(g["stats"], GlobalSource("stats"))
        d = se.track_new(ObjKind.DICT, {"t": se.new_tensor_slot()})
        se.store_attr(s, "last", d)
        return se.build()

    text = build().describe()
    assert text == build().describe()
    assert "0x" not in text
    assert text.splitlines()[1:] == ["  n0 = new dict{'t': t0}", "  G['stats'].last = n0"]


def test_differential_counter_hook_matches_cpython() -> None:
    def make_state() -> dict[str, Any]:
        return {"stats": Stats(), "history": CountingList([1])}

    def hook(g: dict[str, Any], t: str) -> None:
        g["stats"].calls = 1
        g["history"].append({"t": t, "n": 2})

    real = make_state()
    hook(real, "T")

    state = make_state()
    se = SideEffects()
    stats = se.track_existing(state["stats"], GlobalSource("stats"))
    hist = se.track_existing(state["history"], GlobalSource("history"))
    se.store_attr(stats, "calls", 1)
    d = se.track_new(ObjKind.DICT, {"t": se.new_tensor_slot(), "n": 2})
    se.list_append(hist, d)
    replayed = copy.deepcopy(state)
    se.build().apply(Roots((), replayed), ("T",))

    assert vars(replayed["stats"]) == vars(real["stats"])
    assert replayed["history"] == real["history"]
    assert type(replayed["history"]) is CountingList


def test_attr_source_reaches_nested_objects() -> None:
    holder = Stats()
    holder.inner = Stats()  # type: ignore[attr-defined]
    se = SideEffects()
    ref = se.track_existing(holder.inner, AttrSource(ArgSource(0), "inner"))  # type: ignore[attr-defined]
    se.store_attr(ref, "calls", 9)
    plan = se.build()
    fresh = Stats()
    fresh.inner = Stats()  # type: ignore[attr-defined]
    plan.apply(Roots((fresh,), {}))
    assert fresh.inner.calls == 9  # type: ignore[attr-defined]
