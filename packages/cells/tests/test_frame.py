"""Playing the tracer on real functions: nested cells, shadowing, three-deep
captures. Each test traces one instance, replays on a second, runs a third for
real and compares the closures' cells."""

from __future__ import annotations

import functools
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
from loom_sidefx import (
    ArgSource,
    Computed,
    GlobalSource,
    Missing,
    Original,
    Roots,
    SideEffects,
    concrete,
)


def code_of(fn: Callable[..., Any] | types.CodeType, name: str) -> types.CodeType:
    code = fn if isinstance(fn, types.CodeType) else fn.__code__
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def cells_of(fn: Any) -> dict[str, Any]:
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            out[name] = "<empty>"
    return out


def make_three_deep() -> Callable[[Any], int]:
    count = 0
    log: list[Any] = []

    def hook(t: Any) -> int:
        def mid() -> None:
            def inner() -> None:
                nonlocal count
                count += 1
                log.append((count, t))

            inner()

        mid()
        return count

    return hook


def test_three_deep_nonlocal_write_matches_cpython() -> None:
    traced = make_three_deep()
    se = SideEffects()
    cells = CellModel(se)
    root = FrameCells.for_hook(cells, traced)
    root.make_cell("t", Original(ArgSource(0)))  # MAKE_CELL on the argument
    mid_code = code_of(traced, "mid")
    root.make_function(mid_code)
    mid = FrameCells(cells, mid_code, root.closure_for(mid_code))
    inner_code = code_of(mid_code, "inner")
    mid.make_function(inner_code)
    inner = FrameCells(cells, inner_code, mid.closure_for(inner_code))
    count = concrete(inner.load("count"))
    inner.store("count", count + 1)
    log = inner.load("log")
    log_ref = se.track_existing(log.obj, log.source)
    se.list_append(log_ref, (concrete(inner.load("count")), inner.load("t")))
    plan = se.build((root.load("count"),))
    guards = cells.guards()

    assert [g.kind for g in guards] == [GuardKind.EQUALS, GuardKind.IDENTITY]
    assert len(plan.new_objects) == 0, "the functions and the cell for t do not escape"
    replayed, real = make_three_deep(), make_three_deep()
    roots = Roots.of(replayed, ("T",))
    assert not compile_guards(guards)(roots), "identity guard on another instance's list"
    assert plan.apply(roots) == (real("T"),)
    assert cells_of(replayed) == cells_of(real)


def make_shadowing() -> Callable[[], int]:
    x = 0

    def hook() -> int:
        nonlocal x

        def shadow_local() -> int:
            x = 100
            return x

        def shadow_cell() -> int:
            x = 5

            def g() -> int:
                nonlocal x
                x += 1
                return x

            return g()

        x = x + shadow_local() + shadow_cell()
        return x

    return hook


def test_name_shadowing_between_nested_locals_and_the_outer_cell() -> None:
    hook = make_shadowing()
    se = SideEffects()
    cells = CellModel(se)
    root = FrameCells.for_hook(cells, hook)
    local_code = code_of(hook, "shadow_local")
    local_frame = FrameCells(cells, local_code, root.closure_for(local_code))
    with pytest.raises(CellRefused) as info:
        local_frame.cell("x")
    assert info.value.reason.kind is CellRefusalKind.UNKNOWN_NAME
    from_local = 100  # the tracer keeps `x = 100` as a fast local

    cell_code = code_of(hook, "shadow_cell")
    cell_frame = FrameCells(cells, cell_code, cell_frame_closure := root.closure_for(cell_code))
    assert cell_frame_closure == ()
    cell_frame.make_cell("x")
    cell_frame.store("x", 5)
    g_code = code_of(cell_code, "g")
    g_frame = FrameCells(cells, g_code, cell_frame.closure_for(g_code))
    g_frame.store("x", g_frame.load("x") + 1)
    from_cell = g_frame.load("x")

    root.store("x", concrete(root.load("x")) + from_local + from_cell)
    plan = se.build((root.load("x"),))
    assert plan.describe().splitlines()[1:] == [
        "  closure[0:x].cell_contents = 106",
        "  return 106",
    ]
    replayed, real = make_shadowing(), make_shadowing()
    assert plan.apply(Roots.of(replayed, ())) == (real(),)
    assert cells_of(replayed) == cells_of(real) == {"x": 106}


def make_shared() -> tuple[Callable[[], None], Callable[[], int]]:
    shared = 1

    def bump() -> None:
        nonlocal shared
        shared *= 10

    def read() -> int:
        return shared

    return bump, read


def test_a_write_replayed_for_one_hook_is_seen_by_the_other() -> None:
    bump, _read = make_shared()
    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells.for_hook(cells, bump)
    frame.store("shared", concrete(frame.load("shared")) * 10)
    plan = se.build()
    check = compile_guards(cells.guards())

    bump2, read2 = make_shared()
    roots = Roots.of(bump2, ())
    assert check(roots)
    plan.apply(roots)
    assert read2() == 10
    assert not check(roots), "after the write the guard asks for a retrace"


def test_a_helper_function_sharing_the_hooks_cell_uses_the_same_model() -> None:
    bump, read = make_shared()

    def hook() -> int:
        bump()
        return read()

    se = SideEffects()
    cells = CellModel(se)
    bump_frame = FrameCells(cells, bump.__code__, cells.closure_of(bump, GlobalSource("bump")))  # type: ignore[arg-type]
    bump_frame.store("shared", concrete(bump_frame.load("shared")) * 10)
    read_frame = FrameCells(cells, read.__code__, cells.closure_of(read, GlobalSource("read")))  # type: ignore[arg-type]
    result = read_frame.load("shared")
    assert result == 10
    assert [g.describe() for g in cells.guards()] == [
        "G['bump'].__closure__[0:shared].cell_contents == 1"
    ]
    plan = se.build((result,))

    bump2, read2 = make_shared()
    got = plan.apply(Roots((), {"bump": bump2, "read": read2}))
    assert got == (10,) and read2() == 10


def make_late() -> Callable[[], Callable[[], Any]]:
    def hook() -> Callable[[], Any]:
        nonlocal value
        value = "set"
        return peek

    def peek() -> Any:
        return value

    value: Any
    return hook


def test_storing_into_an_empty_preexisting_cell_then_reading_it() -> None:
    hook = make_late()
    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells.for_hook(cells, hook)
    assert se.load_cell(frame.cell("value").ref) is Missing.ABSENT
    frame.store("value", "set")
    assert frame.load("value") == "set"
    assert cells.guards() == ()
    replayed = make_late()
    plan = se.build()
    plan.apply(Roots.of(replayed, ()))
    assert replayed()() == "set"


def test_a_nested_function_returned_by_the_hook_is_materialized_with_shared_cells() -> None:
    def make() -> Callable[[], Callable[[], int]]:
        base = 10

        def hook() -> Callable[[], int]:
            step = 2

            def next_value() -> int:
                nonlocal base
                base += step
                return base

            return next_value

        return hook

    hook = make()
    se = SideEffects()
    cells = CellModel(se)
    root = FrameCells.for_hook(cells, hook)
    root.make_cell("step")
    root.store("step", 2)
    fn = root.make_function(code_of(hook, "next_value"))
    plan = se.build((fn,))
    assert "n0 = new cell(2)" in plan.describe()

    replayed, real = make(), make()
    (made,) = plan.apply(Roots.of(replayed, ()))
    expected = real()
    assert (made(), made()) == (expected(), expected()) == (12, 14)
    assert cells_of(replayed) == cells_of(real)


def test_comprehension_style_rebinding_restores_the_outer_cell() -> None:
    def outer() -> None:
        x = 1  # noqa: F841

    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells(cells, outer.__code__, ())
    outer_x = frame.make_cell("x", 1)
    saved = frame.rebind("x", None)
    inner_x = frame.make_cell("x", 2)
    assert frame.load("x") == 2 and inner_x != outer_x
    frame.rebind("x", saved)
    assert frame.load("x") == 1
    assert se.build().is_empty


def test_guard_policy_chooses_how_reads_are_guarded() -> None:
    class FakeTensor:
        pass

    weights = FakeTensor()
    scale = 2.5

    def hook() -> tuple[Any, float]:
        return weights, scale

    def policy(value: object) -> GuardKind | None:
        return GuardKind.TYPE if isinstance(value, FakeTensor) else GuardKind.EQUALS

    cells = CellModel(SideEffects(), guard_policy=policy)
    frame = FrameCells.for_hook(cells, hook)
    frame.load("weights")
    frame.load("scale")
    frame.load("scale")
    texts = [g.describe() for g in cells.guards()]
    assert texts == [
        f"type(closure[1:weights].cell_contents) is {FakeTensor.__module__}.{FakeTensor.__qualname__}",
        "closure[0:scale].cell_contents == 2.5",
    ]
    assert compile_guards(cells.guards())(Roots.of(hook, ()))


def make_caller() -> Callable[[], int]:
    total = 0

    def hook() -> int:
        step = 3

        def add() -> None:
            nonlocal total
            total += step

        add()
        add()
        return total

    return hook


def test_calling_a_function_the_trace_created_shares_its_cells() -> None:
    hook = make_caller()
    se = SideEffects()
    cells = CellModel(se)
    root = FrameCells.for_hook(cells, hook)
    root.make_cell("step")
    root.store("step", 3)
    add = root.make_function(code_of(hook, "add"))
    for _ in range(2):
        frame = FrameCells.for_new_function(cells, add)
        total = frame.load("total", guard=False)
        frame.store("total", Computed("+", total, frame.load("step")))
    plan = se.build((root.load("total"),))
    assert cells.guards() == ()
    replayed, real = make_caller(), make_caller()
    assert plan.apply(Roots.of(replayed, ())) == (real(),)
    assert cells_of(replayed) == cells_of(real) == {"total": 6}
    assert plan.apply(Roots.of(replayed, ())) == (real(),)


def test_a_value_staged_in_a_made_cell_is_read_by_the_nested_function_capturing_it() -> None:
    def outer() -> Callable[[], Any]:
        x = 1

        def inner() -> Any:
            return x

        return inner

    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells(cells, outer.__code__, ())
    assert "x" not in frame
    frame.make_cell("x")
    assert "x" in frame and "y" not in frame
    staged = object()  # a tracer's own symbolic value
    frame.stage("x", staged)
    inner_code = code_of(outer, "inner")
    inner = FrameCells(cells, inner_code, frame.closure_for(inner_code))
    assert inner.load("x") is staged
    assert cells.guards() == () and se.build().is_empty


def test_for_hook_refuses_what_is_not_a_python_function() -> None:
    cells = CellModel(SideEffects())
    with pytest.raises(
        TypeError, match=r"FrameCells\.for_hook: .*functools\.partial.*def or lambda"
    ):
        FrameCells.for_hook(cells, functools.partial(print))
