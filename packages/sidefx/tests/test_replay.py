"""Replay plans built the way the tracer builds them, applied to live state."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Callable
from typing import Any

import pytest

from loom_sidefx import (
    ArgSource,
    AttrSource,
    CellContentsSource,
    Computed,
    GlobalSource,
    Missing,
    ObjectSource,
    ObjKind,
    OpKind,
    Original,
    PlanCheckError,
    ReplayPlan,
    Roots,
    SideEffects,
    TensorSlot,
    concrete,
)

from .conftest import shape


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


# ----------------------------------------------------------------- differential
Trace = Callable[[SideEffects, dict[str, Any]], tuple[Any, ...]]


def differential(
    make_state: Callable[[], dict[str, Any]],
    real: Callable[[dict[str, Any]], Any],
    trace: Trace,
    tensors: tuple[Any, ...] = (),
) -> ReplayPlan:
    """Trace on one state, replay on a second, run the real code on a third; compare."""
    traced_state = make_state()
    se = SideEffects()
    results = trace(se, traced_state)
    plan = se.build(results)
    plan.check()
    assert shape(traced_state) == shape(make_state()), "tracing mutated live state"

    expected_state = make_state()
    expected_result = real(expected_state)
    replayed_state = make_state()
    got = plan.apply(Roots((), replayed_state), tensors)
    assert shape(replayed_state) == shape(expected_state)
    if results:
        assert shape(got[0] if len(got) == 1 else got) == shape(expected_result)
    return plan


def G(se: SideEffects, g: dict[str, Any], name: str) -> Any:
    return se.track_existing(g[name], GlobalSource(name))


def test_a_new_dict_mutated_after_it_escaped_is_replayed_with_its_final_state() -> None:
    def real(g: dict[str, Any]) -> None:
        d: dict[str, Any] = {}
        g["log"].append(d)
        d["loss"] = "T"
        d["tags"] = ["a"]

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        d = se.track_new(ObjKind.DICT)
        se.list_append(G(se, g, "log"), d)
        se.dict_setitem(d, "loss", se.new_tensor_slot())
        se.dict_setitem(d, "tags", se.track_new(ObjKind.LIST, ["a"]))
        return ()

    differential(lambda: {"log": [1]}, real, trace, ("T",))


def test_a_new_object_shared_by_two_containers_stays_one_object() -> None:
    def real(g: dict[str, Any]) -> None:
        d = {"k": 1}
        g["a"].append(d)
        g["b"]["x"] = d

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        d = se.track_new(ObjKind.DICT, {"k": 1})
        se.list_append(G(se, g, "a"), d)
        se.dict_setitem(G(se, g, "b"), "x", d)
        return ()

    differential(lambda: {"a": [], "b": {}}, real, trace)


def test_a_new_list_that_contains_itself_is_materialized() -> None:
    def real(g: dict[str, Any]) -> None:
        xs: list[Any] = [1]
        xs.append(xs)
        g["out"] = xs

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        xs = se.track_new(ObjKind.LIST, [1])
        se.list_append(xs, xs)
        se.store_global("out", xs)
        return ()

    differential(lambda: {}, real, trace)


def test_deletes_of_attributes_keys_items_and_globals() -> None:
    def make() -> dict[str, Any]:
        obj = Stats()
        obj.tmp = 1  # type: ignore[attr-defined]
        return {"obj": obj, "d": {"a": 1, "b": 2}, "xs": [1, 2, 3], "s": {1, 2}, "gone": 0}

    def real(g: dict[str, Any]) -> None:
        del g["obj"].tmp
        del g["d"]["a"]
        del g["xs"][-2]
        g["s"].discard(1)
        del g["gone"]

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        se.del_attr(G(se, g, "obj"), "tmp")
        se.dict_delitem(G(se, g, "d"), "a")
        se.list_delitem(G(se, g, "xs"), -2)
        se.set_discard(G(se, g, "s"), 1)
        se.del_global("gone")
        return ()

    differential(make, real, trace)


def test_list_extend_reverse_clear_and_set_mutations() -> None:
    def real(g: dict[str, Any]) -> None:
        g["xs"].extend([4, 5])
        g["xs"].reverse()
        g["ys"].clear()
        g["s"].add("c")
        g["s"].update({"d"})
        g["s2"].clear()

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        se.list_extend(G(se, g, "xs"), [4, 5])
        se.list_reverse(G(se, g, "xs"))
        se.list_clear(G(se, g, "ys"))
        se.set_add(G(se, g, "s"), "c")
        se.set_update(G(se, g, "s"), ["d"])
        se.set_clear(G(se, g, "s2"))
        return ()

    differential(lambda: {"xs": [1], "ys": [2], "s": {"a"}, "s2": {1}}, real, trace)


def test_an_original_item_keeps_its_identity_after_the_list_shifts() -> None:
    def make() -> dict[str, Any]:
        first = Stats()
        return {"xs": [first, "b"], "ys": []}

    def real(g: dict[str, Any]) -> None:
        g["xs"].insert(0, "new")
        g["ys"].append(g["xs"][1])

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        xs = G(se, g, "xs")
        se.list_insert(xs, 0, "new")
        se.list_append(G(se, g, "ys"), se.list_items(xs)[1])
        return ()

    plan = differential(make, real, trace)
    g = make()
    plan.apply(Roots((), g))
    assert g["ys"][0] is g["xs"][1]


def test_class_and_module_attributes_are_stored_raw() -> None:
    import types as pytypes

    class Config:
        level = 0

    module = pytypes.ModuleType("m")

    def make() -> dict[str, Any]:
        Config.level = 0
        return {"Config": Config, "m": module}

    def real(g: dict[str, Any]) -> None:
        g["Config"].level = 3
        g["m"].flag = True

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        se.store_attr(G(se, g, "Config"), "level", 3)
        se.store_attr(G(se, g, "m"), "flag", True)
        return ()

    plan = differential(make, real, trace)
    g = make()
    plan.apply(Roots((), g))
    assert Config.level == 3 and module.flag is True  # type: ignore[attr-defined]


def test_new_user_objects_and_subclass_instances_escape_with_their_attributes() -> None:
    def real(g: dict[str, Any]) -> Any:
        rec = Stats()
        rec.calls = 2
        items = CountingList()
        list.append(items, "t")
        items.owner = rec  # type: ignore[attr-defined]
        g["holder"].latest = items
        return rec

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        rec = se.track_new(ObjKind.OBJECT, cls=Stats)
        se.store_attr(rec, "calls", 0)
        se.store_attr(rec, "calls", 2)
        items = se.track_new(ObjKind.LIST, cls=CountingList)
        se.list_append(items, "t")
        se.store_attr(items, "owner", rec)
        se.store_attr(G(se, g, "holder"), "latest", items)
        return (rec,)

    CountingList.appends = 0
    differential(lambda: {"holder": Stats()}, real, trace)
    assert CountingList.appends == 0


def test_results_materialize_new_values_that_do_not_escape() -> None:
    se = SideEffects()
    slot = se.new_tensor_slot()
    d = se.track_new(ObjKind.DICT, {"t": slot})
    plan = se.build((d, (slot, 3)))
    got = plan.apply(Roots((), {}), ("T",))
    assert got == ({"t": "T"}, ("T", 3))
    assert plan.tensor_slots_used == (0,)


def test_a_new_function_capturing_a_new_and_a_preexisting_cell_escapes() -> None:
    import types as pytypes

    def factory() -> Any:
        a = 0
        b = 0

        def inner() -> tuple[int, int]:
            return a, b

        return inner

    code = next(c for c in factory.__code__.co_consts if isinstance(c, pytypes.CodeType))
    live_cell = pytypes.CellType(7)
    se = SideEffects()
    new_cell = se.track_new_cell(5)
    old_cell = se.track_existing(live_cell, GlobalSource("c"))
    fn = se.track_new_function(code, "inner", closure=(new_cell, old_cell))
    g: dict[str, Any] = {"c": live_cell, "hooks": []}
    se.list_append(se.track_existing(g["hooks"], GlobalSource("hooks")), fn)
    plan = se.build()
    assert "new function inner code=inner closure=(n0, G['c'])" in plan.describe()
    plan.apply(Roots((), g))
    (inner,) = g["hooks"]
    assert inner() == (5, 7)
    live_cell.cell_contents = 8
    assert inner() == (5, 8), "the escaped function shares the live pre-existing cell"


def test_preexisting_cell_write_and_delete_replay_through_cell_contents() -> None:
    import types as pytypes

    cell = pytypes.CellType(1)
    se = SideEffects()
    ref = se.track_existing(cell, GlobalSource("cell"))
    assert se.load_cell(ref) == Original(CellContentsSource(GlobalSource("cell")))
    assert concrete(se.load_cell(ref)) == 1
    se.store_cell(ref, 2)
    se.del_cell(ref)
    assert se.load_cell(ref) is Missing.ABSENT
    se.store_cell(ref, 3)
    plan = se.build()
    target = pytypes.CellType(0)
    plan.apply(Roots((), {"cell": target}))
    assert target.cell_contents == 3


# ----------------------------------------------------------------------- check
def _valid_plan() -> ReplayPlan:
    g: dict[str, Any] = {"xs": [], "d": {}}
    se = SideEffects()
    xs = se.track_existing(g["xs"], GlobalSource("xs"))
    new = se.track_new(ObjKind.DICT, {"t": se.new_tensor_slot()})
    se.list_append(xs, new)
    se.dict_setitem(se.track_existing(g["d"], GlobalSource("d")), "k", 1)
    return se.build()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: dataclasses.replace(p, num_tensor_slots=0), "tensor slot 0 out of range"),
        (lambda p: dataclasses.replace(p, new_objects=()), "which the plan does not define"),
        (
            lambda p: dataclasses.replace(
                p, ops=(dataclasses.replace(p.ops[0], target=p.new_objects[0].ref),)
            ),
            "is not pre-existing",
        ),
        (
            lambda p: dataclasses.replace(
                p, ops=(dataclasses.replace(p.ops[0], kind=OpKind.DICT_CLEAR),)
            ),
            "is a list",
        ),
        (
            lambda p: dataclasses.replace(p, ops=(dataclasses.replace(p.ops[1], key=[1]),)),
            "not a hashable constant",
        ),
        (
            lambda p: dataclasses.replace(p, ops=(dataclasses.replace(p.ops[0], args=()),)),
            "expects 1 values",
        ),
        (lambda p: dataclasses.replace(p, preexisting=p.preexisting * 2), "listed twice"),
        (lambda p: dataclasses.replace(p, results=(object(),)), "is not replayable"),
        (
            lambda p: dataclasses.replace(
                p, new_objects=(dataclasses.replace(p.new_objects[0], cls=list),)
            ),
            "has class",
        ),
    ],
)
def test_check_names_the_corruption(
    corrupt: Callable[[ReplayPlan], ReplayPlan], message: str
) -> None:
    plan = _valid_plan()
    plan.check()
    with pytest.raises(PlanCheckError, match=message):
        corrupt(plan).check()


def test_a_plan_is_reusable_across_calls_and_compiles_once() -> None:
    plan = _valid_plan()
    for i in range(3):
        g: dict[str, Any] = {"xs": [], "d": {}}
        plan.apply(Roots((), g), (i,))
        assert g == {"xs": [{"t": i}], "d": {"k": 1}}


def test_computed_values_are_evaluated_at_replay_time_from_the_state_before() -> None:
    def real(g: dict[str, Any]) -> None:
        g["stats"].calls += 1
        g["total"] = g["total"] * 2 + g["stats"].calls

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        stats = G(se, g, "stats")
        calls = Computed("+", Original(AttrSource(GlobalSource("stats"), "calls")), 1)
        se.store_attr(stats, "calls", calls)
        total = Computed(
            "+", Computed("*", Original(GlobalSource("total")), 2), se.load_attr(stats, "calls")
        )
        se.store_global("total", total)
        return ()

    def make() -> dict[str, Any]:
        stats = Stats()
        stats.calls = 4
        return {"stats": stats, "total": 10}

    plan = differential(make, real, trace)
    assert "G['total'] = ((G['total'] * 2) + (G['stats'].calls + 1))" in plan.describe()


def test_unknown_computed_operators_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown Computed operator"):
        Computed("@", 1, 2)


def test_a_store_into_another_modules_globals_goes_through_an_object_source() -> None:
    other: dict[str, Any] = {"registry": {}}
    se = SideEffects()
    ns = se.track_existing(other, ObjectSource(other, "globals:plugins"))
    se.dict_setitem(ns, "enabled", True)
    reg = se.dict_lookup(ns, "registry")
    se.dict_setitem(se.track_existing(reg.obj, reg.source), "k", 1)
    plan = se.build()
    assert plan.describe().splitlines()[1:] == [
        "  dict.__setitem__(globals:plugins, 'enabled', True)",
        "  dict.__setitem__(globals:plugins['registry'], 'k', 1)",
    ]
    plan.apply(Roots((), {}))
    assert other == {"registry": {"k": 1}, "enabled": True}


class Tracked:
    """A class whose __setattr__/__delattr__ keep a log (like nn.Module's bookkeeping)."""

    def __init__(self) -> None:
        object.__setattr__(self, "log", [])
        object.__setattr__(self, "buffer", 0)

    def __setattr__(self, name: str, value: Any) -> None:
        self.log.append(("set", name))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.log.append(("del", name))
        object.__delattr__(self, name)


def test_generic_attribute_ops_run_the_types_setattr_once_at_replay() -> None:
    def real(g: dict[str, Any]) -> None:
        g["m"].buffer = "T"
        del g["m"].buffer

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        m = G(se, g, "m")
        se.store_attr(m, "buffer", se.new_tensor_slot(), generic=True)
        assert se.load_attr(m, "buffer") == TensorSlot(0)
        se.del_attr(m, "buffer", generic=True)
        return ()

    plan = differential(lambda: {"m": Tracked()}, real, trace, ("T",))
    assert plan.describe().splitlines()[1:] == [
        "  setattr(G['m'], 'buffer', t0)",
        "  delattr(G['m'], 'buffer')",
    ]
    g = {"m": Tracked()}
    plan.apply(Roots((), g), ("T",))
    assert g["m"].log == [("set", "buffer"), ("del", "buffer")]


def test_every_op_kind_replays_like_cpython() -> None:
    """One hook touching every op kind: the plan covers OpKind and matches CPython."""

    def make() -> dict[str, Any]:
        obj = Stats()
        obj.old = 1  # type: ignore[attr-defined]
        return {
            "obj": obj,
            "m": Tracked(),
            "xs": CountingList([1, 2, 3, 4]),
            "d": CountingDict({"a": 1, (1, 2): 2, 2.5: 3}),
            "s": {1, 2},
            "cell": types.CellType(0),
            "gone": 1,
        }

    def real(g: dict[str, Any]) -> Any:
        g["obj"].new = math.nan
        del g["obj"].old
        g["m"].extra = 1
        del g["m"].buffer
        xs = g["xs"]
        list.append(xs, "a")
        list.extend(xs, ["b", "c"])
        xs[0] = "z"
        del xs[1]
        xs.insert(-1, "i")
        xs.pop(0)
        xs.reverse()
        d = g["d"]
        dict.__setitem__(d, (1, 2), "tuple")
        del d[2.5]
        g["s"].add(3)
        g["s"].discard(1)
        g["cell"].cell_contents = g["cell"].cell_contents + 5
        g["flag"] = min(g["gone"], 0)
        del g["gone"]
        snapshot = list(xs)
        xs.clear()
        d.clear()
        g["s"].clear()
        del g["cell"].cell_contents
        return snapshot

    def trace(se: SideEffects, g: dict[str, Any]) -> tuple[Any, ...]:
        obj = G(se, g, "obj")
        se.store_attr(obj, "new", math.nan)
        se.del_attr(obj, "old")
        m = G(se, g, "m")
        se.store_attr(m, "extra", 1, generic=True)
        se.del_attr(m, "buffer", generic=True)
        xs = G(se, g, "xs")
        se.list_append(xs, "a")
        se.list_extend(xs, ["b", "c"])
        se.list_setitem(xs, 0, "z")
        se.list_delitem(xs, 1)
        se.list_insert(xs, -1, "i")
        se.list_pop(xs, 0)
        se.list_reverse(xs)
        d = G(se, g, "d")
        se.dict_setitem(d, (1, 2), "tuple")
        se.dict_delitem(d, 2.5)
        s = G(se, g, "s")
        se.set_add(s, 3)
        se.set_discard(s, 1)
        cell = G(se, g, "cell")
        se.store_cell(cell, Computed("+", se.load_cell(cell), 5))
        se.store_global("flag", Computed("min", Original(GlobalSource("gone")), 0))
        se.del_global("gone")
        snapshot = se.track_new(ObjKind.LIST, se.list_items(xs))
        se.list_clear(xs)
        se.dict_clear(d)
        se.set_clear(s)
        se.del_cell(cell)
        return (snapshot,)

    plan = differential(make, real, trace)
    assert {op.kind for op in plan.ops} == set(OpKind)
    assert "0x" not in plan.program_text()


def test_a_plan_pickles_as_data_and_replays_after_unpickling() -> None:
    import pickle

    plan = _valid_plan()
    plan.apply(Roots((), {"xs": [], "d": {}}), (0,))  # compiles the program
    copy_ = pickle.loads(pickle.dumps(plan))
    assert copy_ == plan and copy_.describe() == plan.describe()
    g: dict[str, Any] = {"xs": [], "d": {}}
    copy_.apply(Roots((), g), ("t",))
    assert g == {"xs": [{"t": "t"}], "d": {"k": 1}}
