"""Per-call cost of hook guards and side-effect replay (pure Python, CPU).

Every compiled call of a traced hook runs its guard function and, after the
graph, its replay plan. This measures both for a typical hook (a nonlocal
counter, a global config, a log list, an argument attribute) against the same
checks and mutations written by hand in plain Python, which is the floor.

    python benchmarks/bench_guards.py --device cpu
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio, time_fn

from loom_cells import CellModel, FrameCells
from loom_sidefx import (
    ArgSource,
    GlobalSource,
    Guard,
    GuardKind,
    ObjKind,
    Roots,
    SideEffects,
    compile_guards,
    concrete,
)

INNER = 1000  # calls per timed sample, so one sample is well above timer resolution


class Ctx:
    def __init__(self) -> None:
        self.step = 0


def make_hook() -> types.FunctionType:
    count = 0

    def hook(ctx: Ctx, t: Any) -> Any:
        nonlocal count
        count += 1
        if CONFIG["enabled"]:
            LOG.append({"t": t, "n": count})
        ctx.step = count
        return t

    return hook  # type: ignore[return-value]


CONFIG = {"enabled": True, "scale": 2.0}
LOG: list[Any] = []


def trace(hook: types.FunctionType) -> tuple[Any, Any]:
    """What the tracer records for ``hook`` (built by hand here)."""
    se = SideEffects()
    cells = CellModel(se)
    frame = FrameCells.for_hook(cells, hook)
    n = concrete(frame.load("count")) + 1
    frame.store("count", n)
    log = se.track_existing(LOG, GlobalSource("LOG"))
    entry = se.track_new(ObjKind.DICT, {"t": se.new_tensor_slot(), "n": n})
    se.list_append(log, entry)
    se.store_attr(se.track_existing(Ctx(), ArgSource(0)), "step", n)
    guards = (
        *cells.guards(),
        Guard(GuardKind.IDENTITY, GlobalSource("CONFIG"), CONFIG),
        Guard(GuardKind.TYPE, GlobalSource("CONFIG"), dict),
        Guard(GuardKind.IDENTITY, GlobalSource("LOG"), LOG),
        Guard(GuardKind.TYPE, ArgSource(0), Ctx),
    )
    return compile_guards(guards), se.build()


def main() -> None:
    args = parse_args("hook guards and replay, per call")
    hook = make_hook()
    check, plan = trace(hook)
    ctx = Ctx()
    roots = Roots.of(hook, (ctx, "T"))
    cell = hook.__closure__[0]  # type: ignore[index]
    g = hook.__globals__

    def by_hand_guards() -> bool:
        return (
            type(cell.cell_contents) is int
            and cell.cell_contents == 0
            and g["CONFIG"] is CONFIG
            and type(g["CONFIG"]) is dict
            and g["LOG"] is LOG
            and type(ctx) is Ctx
        )

    def by_hand_replay() -> None:
        cell.cell_contents = 1
        list.append(g["LOG"], {"t": "T", "n": 1})
        object.__setattr__(ctx, "step", 1)

    def loop(fn: Any) -> Any:
        def run() -> None:
            for _ in range(INNER):
                fn()

        return run

    assert check(roots) and by_hand_guards()
    outputs = ("T",)
    variants = {
        "guards: compile_guards (5 guards)": lambda: check(roots),
        "guards: by hand": by_hand_guards,
        "replay: ReplayPlan.apply": lambda: plan.apply(roots, outputs),
        "replay: by hand": by_hand_replay,
    }
    rows = []
    for name, fn in variants.items():
        LOG.clear()
        t = time_fn(loop(fn), warmup=3, iters=args.iters, device="cpu")
        rows.append({"variant": name, "us_per_call": t.median_s / INNER * 1e6})
        LOG.clear()
    for row, ref in ((rows[0], rows[1]), (rows[2], rows[3])):
        row["vs_by_hand"] = ratio(row["us_per_call"], ref["us_per_call"])
    print(format_table(rows))
    print(plan.describe())
    if not args.no_append:
        append_results(
            "guards",
            "Hook guards and side-effect replay, per call (CPU, pure Python)",
            rows,
            notes=f"median of {args.iters} samples of {INNER} calls; target: 5 guards under 5 us",
            device="cpu",
        )


if __name__ == "__main__":
    main()
