"""Cells modeled by cell identity: guards on reads, replayed writes."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest

from loom_cells import (
    CellModel,
    CellRefusalKind,
    CellRefused,
    FrameCells,
    GuardKind,
    compile_guards,
)
from loom_sidefx import ClosureSource, Computed, GlobalSource, Roots, SideEffects, concrete


def nested_code(fn: Callable[..., Any], name: str) -> types.CodeType:
    return next(
        c for c in fn.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name
    )


def make_counter() -> Callable[[], int]:
    count = 0

    def hook() -> int:
        nonlocal count
        count += 1
        return count

    return hook


def make_pair() -> tuple[Callable[[], None], Callable[[], int]]:
    shared = 10

    def bump() -> None:
        nonlocal shared
        shared += 1

    def read() -> int:
        return shared

    return bump, read


def test_nonlocal_counter_write_is_replayed_through_cell_contents() -> None:
    hook = make_counter()
    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells.for_hook(cells, hook)
    assert concrete(frame.load("count")) == 0
    frame.store("count", 1)
    plan, guards = se.build(), cells.guards()

    assert [g.describe() for g in guards] == ["closure[0:count].cell_contents == 0"]
    roots = Roots.of(hook, ())
    check = compile_guards(guards)
    assert check(roots)
    plan.apply(roots)
    assert hook.__closure__[0].cell_contents == 1  # type: ignore[index]
    assert not check(roots), "the guard fails once the counter moved"
    assert hook() == 2, "the real function sees the replayed write"


def test_two_functions_sharing_a_cell_share_one_model() -> None:
    bump, read = make_pair()
    se = SideEffects()
    cells = CellModel(se)
    (a,) = cells.hook_closure(bump)  # type: ignore[arg-type]
    (b,) = cells.closure_of(read, GlobalSource("read"))  # type: ignore[arg-type]
    assert a is b
    cells.store(a, 11)
    assert cells.load(b) == 11, "the write through one function is seen through the other"
    assert cells.guards() == (), "no guard: the value read was written by the trace"


def test_another_cell_holding_an_equal_value_is_another_cell() -> None:
    h1, h2 = make_counter(), make_counter()
    se = SideEffects()
    cells = CellModel(se)
    (a,) = cells.hook_closure(h1)  # type: ignore[arg-type]
    (b,) = cells.closure_of(h2, GlobalSource("h2"))  # type: ignore[arg-type]
    assert a != b
    cells.store(a, 5)
    assert concrete(cells.load(b)) == 0


def test_read_of_an_object_guards_identity_and_of_a_constant_guards_value() -> None:
    payload: list[int] = []
    name = "x"

    def hook() -> tuple[list[int], str]:
        return payload, name

    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells.for_hook(cells, hook)
    frame.load("payload")
    frame.load("name")
    kinds = {g.source.describe(): g.kind for g in cells.guards()}
    assert kinds == {
        "closure[0:name].cell_contents": GuardKind.EQUALS,
        "closure[1:payload].cell_contents": GuardKind.IDENTITY,
    }


def test_reading_an_empty_cell_is_refused() -> None:
    def outer() -> Callable[[], Any]:
        def hook() -> Any:
            return late

        return hook
        late = 1  # never runs: the cell stays empty

    hook = outer()
    cells = CellModel(SideEffects())
    frame = FrameCells.for_hook(cells, hook)
    with pytest.raises(CellRefused) as info:
        frame.load("late")
    assert info.value.reason.kind is CellRefusalKind.EMPTY_CELL


def test_new_cell_captured_by_nested_function_is_pruned_unless_it_escapes() -> None:
    def outer() -> Any:
        x = 1

        def inner() -> int:
            return x

        return inner

    inner_code = nested_code(outer, "inner")
    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells(cells, outer.__code__, ())
    frame.make_cell("x")
    frame.store("x", 1)
    fn = frame.make_function(inner_code)
    assert se.build().is_empty, "neither the cell nor the function escapes"

    g: dict[str, Any] = {"hooks": []}
    se.list_append(se.track_existing(g["hooks"], GlobalSource("hooks")), fn)
    plan = se.build()
    plan.apply(Roots((), g))
    assert g["hooks"][0]() == 1


def test_cell_source_is_the_closure_slot() -> None:
    hook = make_counter()
    cells = CellModel(SideEffects())
    (c,) = cells.hook_closure(hook)  # type: ignore[arg-type]
    assert cells.side_effects.source_of(c.ref) == ClosureSource(0, "count")


def test_cells_of_a_sourceless_function_cannot_be_written_or_guarded() -> None:
    hook = make_counter()
    cells = CellModel(SideEffects())
    (c,) = cells.closure_of(hook, None)  # type: ignore[arg-type]
    with pytest.raises(CellRefused) as info:
        cells.load(c)
    assert info.value.reason.kind is CellRefusalKind.NO_SOURCE
    with pytest.raises(CellRefused) as info:
        cells.store(c, 1)
    assert info.value.reason.kind is CellRefusalKind.NO_SOURCE
    unguarded = CellModel(SideEffects(), guard_policy=lambda v: None)
    (c2,) = unguarded.closure_of(hook, None)  # type: ignore[arg-type]
    assert unguarded.load(c2) == 0, "a read the policy does not guard needs no source"


def test_non_cells_and_wrong_closures_are_refused() -> None:
    cells = CellModel(SideEffects())
    with pytest.raises(CellRefused) as info:
        cells.existing(42, ClosureSource(0, "x"))  # type: ignore[arg-type]
    assert info.value.reason.kind is CellRefusalKind.NOT_A_CELL
    hook = make_counter()
    with pytest.raises(CellRefused) as info:
        FrameCells(cells, hook.__code__, ())
    assert info.value.reason.kind is CellRefusalKind.NOT_A_CELL


def test_a_counter_replayed_as_arithmetic_needs_no_guard() -> None:
    hook = make_counter()
    se = SideEffects()
    cells = CellModel(se)
    (count,) = cells.hook_closure(hook)  # type: ignore[arg-type]
    current = cells.load(count, guard=False)
    cells.store(count, Computed("+", current, 1))
    plan = se.build()
    assert cells.guards() == ()
    assert plan.describe().splitlines()[1:] == [
        "  closure[0:count].cell_contents = (closure[0:count].cell_contents + 1)"
    ]
    roots = Roots.of(hook, ())
    for _ in range(3):
        plan.apply(roots)
    assert hook() == 4, "three replays and one real call"


def test_a_deferred_guard_is_added_when_the_tracer_specializes() -> None:
    hook = make_counter()
    cells = CellModel(SideEffects())
    (count,) = cells.hook_closure(hook)  # type: ignore[arg-type]
    cells.load(count, guard=False)
    assert cells.guards() == ()
    guard = cells.guard_read(count)
    assert guard is not None and cells.guards() == (guard,)
    assert guard.describe() == "closure[0:count].cell_contents == 0"
    cells.store(count, 1)
    assert cells.guard_read(count) is None, "a written cell is symbolic"


def test_rollback_forgets_cells_guards_and_writes_of_an_abandoned_speculation() -> None:
    bump, _ = make_pair()
    se = SideEffects()
    cells = CellModel(se)
    (shared,) = cells.hook_closure(bump)  # type: ignore[arg-type]
    cp = cells.checkpoint()
    cells.load(shared)
    cells.store(shared, 99)
    cells.new_cell("tmp", 1)
    cells.rollback(cp)
    assert cells.guards() == ()
    assert concrete(cells.load(shared, guard=False)) == 10
    assert se.build().is_empty
    assert cells.existing(bump.__closure__[0], ClosureSource(0, "shared")) == shared  # type: ignore[index]


class Symbolic:
    """A tracer's own symbolic value (not a recorded value)."""


def test_a_staged_write_is_read_back_unguarded_through_every_function_sharing_the_cell() -> None:
    bump, read = make_pair()
    se = SideEffects()
    cells = CellModel(se)
    (a,) = cells.hook_closure(bump)  # type: ignore[arg-type]
    (b,) = cells.closure_of(read, GlobalSource("read"))  # type: ignore[arg-type]
    assert concrete(cells.load(a)) == 10
    staged = Symbolic()
    cells.stage(a, staged)
    assert cells.load(b) is staged
    assert cells.guard_read(b) is None, "the trace wrote the cell: its value is symbolic"
    assert [g.describe() for g in cells.guards()] == ["closure[0:shared].cell_contents == 10"]
    assert se.build().is_empty, "nothing is recorded until the tracer stores the recorded value"
    cells.store(a, Computed("+", 10, 1))
    assert cells.load(b) == Computed("+", 10, 1), "a recorded store replaces the staged value"
    plan = se.build()
    roots = Roots.of(bump, ())
    plan.apply(roots)
    assert read() == 11


def test_staging_in_a_new_cell_needs_no_source_and_records_nothing() -> None:
    se = SideEffects()
    cells = CellModel(se)
    cell = cells.new_cell("x")
    staged = Symbolic()
    cells.stage(cell, staged)
    assert cells.load(cell) is staged
    assert cells.guards() == () and se.build().is_empty


def test_staging_into_a_cell_without_a_source_is_refused() -> None:
    hook = make_counter()
    cells = CellModel(SideEffects())
    (c,) = cells.closure_of(hook, None)  # type: ignore[arg-type]
    with pytest.raises(CellRefused) as info:
        cells.stage(c, Symbolic())
    assert info.value.reason.kind is CellRefusalKind.NO_SOURCE


def test_rollback_restores_the_staged_contents() -> None:
    cells = CellModel(SideEffects())
    cell = cells.new_cell("x")
    first, second = Symbolic(), Symbolic()
    cells.stage(cell, first)
    cp = cells.checkpoint()
    cells.stage(cell, second)
    assert cells.load(cell) is second
    cells.rollback(cp)
    assert cells.load(cell) is first
