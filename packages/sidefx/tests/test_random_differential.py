"""Randomized differential test: random mutation sequences on pre-existing and
new containers, run for real on one copy of the state, recorded on another.
After every step the builder's symbolic views must match the real state; at
the end the replay plan applied to a third copy must reproduce it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from loom_sidefx import (
    GlobalSource,
    ObjKind,
    Original,
    Ref,
    Roots,
    SideEffects,
    TensorSlot,
)

from .conftest import shape


class SubList(list[Any]):
    def append(self, value: Any) -> None:
        raise AssertionError("replay must not call an overridden append")

    def __setitem__(self, index: Any, value: Any) -> None:
        raise AssertionError("replay must not call an overridden __setitem__")


class SubDict(dict[Any, Any]):
    def __setitem__(self, key: Any, value: Any) -> None:
        raise AssertionError("replay must not call an overridden __setitem__")


def make_state() -> dict[str, Any]:
    return {
        "l": [1, "a", None],
        "sl": SubList([0, 1]),
        "d": {"x": 1, 2: "two"},
        "sd": SubDict({"k": 0}),
        "s": {1, "b"},
    }


TOKENS = tuple(f"T{i}" for i in range(64))  # stand-ins for the graph's tensor outputs
KEYS = ("x", "y", 2, 3.5, (1, "t"), None, True)


class Run:
    """Applies each random step to the real state and records it in the builder."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.real = make_state()
        self.se = SideEffects()
        self.refs: dict[str, Ref] = {
            name: self.se.track_existing(self.real_copy[name], GlobalSource(name))
            for name in self.real
        }
        self.new: list[tuple[Ref, Any]] = []  # (ref, the real object it stands for)
        self.slots = 0

    @property
    def real_copy(self) -> dict[str, Any]:
        # the builder tracks its own copy, which must stay untouched
        if not hasattr(self, "_traced"):
            self._traced = make_state()
        return self._traced

    def value(self) -> tuple[Any, Any]:
        """A (recorded value, real value) pair."""
        pick = self.rng.random()
        if pick < 0.4:
            v = self.rng.choice([0, 1, -2, "s", None, 2.5, (1, 2), True])
            return v, v
        if pick < 0.6 and self.slots < len(TOKENS):
            self.slots += 1
            slot = self.se.new_tensor_slot()
            return slot, TOKENS[slot.index]
        if pick < 0.8 and self.new:
            return self.rng.choice(self.new)
        items = [self.rng.randint(0, 9) for _ in range(self.rng.randint(0, 2))]
        if self.rng.random() < 0.5:
            ref, obj = self.se.track_new(ObjKind.LIST, items), list(items)
        else:
            ref, obj = (
                self.se.track_new(ObjKind.DICT, {"i": items[0] if items else 0}),
                {"i": items[0] if items else 0},
            )
        self.new.append((ref, obj))
        return ref, obj

    def target(self, kind: ObjKind) -> tuple[Ref, Any]:
        pre = [(self.refs[n], self.real[n]) for n in self.real if self.refs[n].kind is kind]
        new = [(r, o) for r, o in self.new if r.kind is kind]
        return self.rng.choice(pre + new if self.rng.random() < 0.3 else pre)

    def step(self) -> None:
        kind = self.rng.choice([ObjKind.LIST, ObjKind.LIST, ObjKind.DICT, ObjKind.SET])
        if kind is ObjKind.SET:
            ref, obj = self.refs["s"], self.real["s"]
        else:
            ref, obj = self.target(kind)
        getattr(self, f"step_{kind.value}")(ref, obj)

    def step_list(self, ref: Ref, obj: list[Any]) -> None:
        se, rng, n = self.se, self.rng, len(obj)
        op = rng.choice(
            ["append", "extend", "setitem", "delitem", "insert", "pop", "clear", "reverse"]
        )
        if op in ("setitem", "delitem", "pop") and n == 0:
            op = "append"
        if op == "append":
            v, real = self.value()
            se.list_append(ref, v)
            list.append(obj, real)
        elif op == "extend":
            pairs = [self.value() for _ in range(rng.randint(0, 3))]
            se.list_extend(ref, [p[0] for p in pairs])
            list.extend(obj, [p[1] for p in pairs])
        elif op == "setitem":
            i = rng.randint(-n, n - 1)
            v, real = self.value()
            se.list_setitem(ref, i, v)
            list.__setitem__(obj, i, real)
        elif op == "delitem":
            i = rng.randint(-n, n - 1)
            se.list_delitem(ref, i)
            del obj[i]
        elif op == "insert":
            i = rng.randint(-n - 2, n + 2)
            v, real = self.value()
            se.list_insert(ref, i, v)
            obj.insert(i, real)
        elif op == "pop":
            i = rng.randint(-n, n - 1)
            got = se.list_pop(ref, i)
            assert self.to_py(got) == self.canon(obj.pop(i))
        elif op == "clear":
            se.list_clear(ref)
            obj.clear()
        else:
            se.list_reverse(ref)
            obj.reverse()

    def step_dict(self, ref: Ref, obj: dict[Any, Any]) -> None:
        se, rng = self.se, self.rng
        op = rng.choice(["setitem", "setitem", "delitem", "pop", "setdefault", "update", "clear"])
        key = rng.choice(KEYS)
        if op == "setitem":
            v, real = self.value()
            se.dict_setitem(ref, key, v)
            dict.__setitem__(obj, key, real)
        elif op == "delitem":
            if key in obj:
                se.dict_delitem(ref, key)
                del obj[key]
        elif op == "pop":
            got = se.dict_pop(ref, key, "default")
            assert self.to_py(got) == self.canon(obj.pop(key, "default"))
        elif op == "setdefault":
            v, real = self.value()
            got = se.dict_setdefault(ref, key, v)
            assert self.to_py(got) == self.canon(obj.setdefault(key, real))
        elif op == "update":
            pairs = [(rng.choice(KEYS), self.value()) for _ in range(2)]
            se.dict_update(ref, [(k, p[0]) for k, p in pairs])
            for k, p in pairs:
                dict.__setitem__(obj, k, p[1])
        else:
            se.dict_clear(ref)
            obj.clear()

    def step_set(self, ref: Ref, obj: set[Any]) -> None:
        se, rng = self.se, self.rng
        op = rng.choice(["add", "discard", "update", "clear"])
        element = rng.choice(KEYS)
        if op == "add":
            se.set_add(ref, element)
            obj.add(element)
        elif op == "discard":
            se.set_discard(ref, element)
            obj.discard(element)
        elif op == "update":
            se.set_update(ref, [element, "u"])
            obj.update([element, "u"])
        else:
            se.set_clear(ref)
            obj.clear()

    def canon(self, real: Any, path: tuple[int, ...] = ()) -> Any:
        """Real objects compared by content; a cycle shows as its depth on the path."""
        if isinstance(real, list | dict):
            if id(real) in path:
                return ("cycle", path.index(id(real)))
            path = (*path, id(real))
            if isinstance(real, list):
                return ("list", [self.canon(x, path) for x in real])
            return ("dict", [(k, self.canon(v, path)) for k, v in real.items()])
        return real

    def to_py(self, v: Any, path: tuple[Ref, ...] = ()) -> Any:
        """The builder's symbolic view of a value, in the same form as ``canon``."""
        if isinstance(v, Original):
            return self.canon(v.obj)
        if isinstance(v, TensorSlot):
            return TOKENS[v.index]
        if isinstance(v, Ref):
            if v in path:
                return ("cycle", path.index(v))
            path = (*path, v)
            if v.kind is ObjKind.LIST:
                return ("list", [self.to_py(x, path) for x in self.se.list_items(v)])
            return ("dict", [(k, self.to_py(x, path)) for k, x in self.se.dict_items(v)])
        return v

    def check_views(self) -> None:
        for name, ref in self.refs.items():
            real = self.real[name]
            if ref.kind is ObjKind.SET:
                assert set(self.se.set_items(ref)) == real
            else:
                assert self.to_py(ref) == self.canon(real), name
        for ref, real in self.new:
            assert self.to_py(ref) == self.canon(real)


@pytest.mark.parametrize("seed", range(60))
def test_random_mutation_sequences_replay_like_cpython(seed: int) -> None:
    rng = random.Random(seed)
    run = Run(rng)
    for _ in range(25):
        run.step()
        run.check_views()
    plan = run.se.build()
    plan.check()
    assert shape(run.real_copy) == shape(make_state()), "tracing mutated live state"
    replayed = make_state()
    plan.apply(Roots((), replayed), TOKENS)
    assert shape(replayed) == shape(run.real)
    for name in ("sl", "sd"):
        assert type(replayed[name]) is type(run.real[name])


def test_random_sequences_cover_every_recording_method() -> None:
    seen: set[str] = set()
    original: Callable[..., Any] = SideEffects.__getattribute__

    def spy(self: SideEffects, name: str) -> Any:
        if name.startswith(("list_", "dict_", "set_")):
            seen.add(name)
        return original(self, name)

    SideEffects.__getattribute__ = spy  # type: ignore[method-assign]
    try:
        for seed in range(60):
            run = Run(random.Random(seed))
            for _ in range(25):
                run.step()
    finally:
        SideEffects.__getattribute__ = original  # type: ignore[method-assign]
    recording = {n for n in dir(SideEffects) if n.startswith(("list_", "dict_", "set_"))}
    views = {"list_items", "dict_items", "dict_lookup", "set_items"}
    assert recording - views - {"set_remove"} <= seen
