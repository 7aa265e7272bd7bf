"""loom's CUDA graphs against Inductor ``reduce-overhead`` and a raw hand-captured replay.

Side by side in one process, per workload:

- ``inductor``: Inductor's default path (no CUDA graphs);
- ``inductor-ro``: ``mode="reduce-overhead"`` (cudagraph trees, graph partitioning);
- ``loom-cg``: ``backend="loom", options={"cudagraphs": True}``;
- ``raw-graph``: the Inductor-compiled step captured once by hand in a
  ``torch.cuda.CUDAGraph`` and replayed (the floor any runtime can reach);
- ``loom-cg runtime``: loom's CUDA-graph runtime alone, the boxed callable
  AOTAutograd calls, called with the inputs AOTAutograd passed it (recorded
  with ``CudagraphRuntime.record_calls``): no Dynamo guards, no AOTAutograd or
  compiled-function wrappers. Measured for steps that make one runtime call
  (inference); ``raw-graph`` and ``loom-cg runtime`` are timed in interleaved
  rounds, the end-to-end variants one after the other (each after a Dynamo reset).

Workloads: the foundation's launch-bound ones (batch-8 MLP inference, MLP and
GPT-stack training steps, batch-1 GPT inference), a one-kernel graph (the
runtime's own cost per call) and a graph with a CPU op in the middle. Reported:
median step times, ratios to ``raw-graph``, ``inductor-ro`` and ``inductor``,
memory against ``inductor-ro`` and loom's capture coverage. Memory, as in
``bench_hf``: ``peak_mib`` is one warm step's peak allocation above what was
allocated before it; ``resident_mib`` what the variant keeps reserved after its
first calls beyond the reading before its build (CUDA-graph pools count whole;
read by ``_harness.reserved_memory``); ``footprint_mib`` their sum, the memory
the step needs, and ``footprint_vs_ro`` its ratio to reduce-overhead's.

Targets (GPU): loom-cg <= inductor-ro and <= 1.15x raw-graph on the foundation
workloads; the runtime's own cost (``loom-cg runtime``) <= 1.5x raw-graph on the
one-kernel graph; on the CPU-op graph faster than inductor and <= inductor-ro.

``--micro`` times the runtime's per-call Python path on the host instead: one
graph built with ``build_runtime`` and a capturer whose replay does nothing.

    python benchmarks/bench_cudagraph.py --device cuda
    python benchmarks/bench_cudagraph.py --device cpu --quick --no-append   # smoke run
    python benchmarks/bench_cudagraph.py --micro --no-append                # host per-call path
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    Timing,
    append_results,
    format_table,
    parse_args,
    peak_memory,
    ratio,
    reserved_memory,
    time_fn,
)
from workloads import size_for, step, workloads

from loom_cudagraph import CudagraphRuntime

FOUNDATION_TARGET_RAW = 1.15
ONE_KERNEL_TARGET_RAW = 1.5

Step = Callable[[], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """A workload: ``build(device, quick)`` returns ``make_step(wrap)`` for a compile wrapper."""

    name: str
    kind: str  # "foundation", "one_kernel", "cpu_op"
    build: Callable[[torch.device, bool], Callable[[Callable[[Any], Any]], tuple[Step, Any]]]


def _foundation_cases() -> list[Case]:
    cases = []
    for w in workloads():

        def build(device: torch.device, quick: bool, w: Any = w) -> Any:
            base, x = w.build(size_for(device, quick), device)

            def make(wrap: Callable[[Any], Any]) -> tuple[Step, Any]:
                model = copy.deepcopy(base)
                params = [p for p in model.parameters() if p.requires_grad]
                fn = wrap(model)
                return (lambda: step(fn, params, x, w.train)), model

            return make

        cases.append(Case(w.name, "foundation", build))
    return cases


def _one_kernel(device: torch.device, quick: bool) -> Any:
    x = torch.randn(1024, device=device)

    def make(wrap: Callable[[Any], Any]) -> tuple[Step, Any]:
        fn = wrap(lambda t: t * 2 + 1)
        return (lambda: fn(x)), None

    return make


def _cpu_op(device: torch.device, quick: bool) -> Any:
    n = 64 if quick else 256
    x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a1 = torch.relu(a @ b) + 1
        b1 = (b * 2).sum(0)
        host = b1.cpu() + 1  # a CPU op in the middle
        return torch.tanh(a1 @ a) + host.to(a.device)

    def make(wrap: Callable[[Any], Any]) -> tuple[Step, Any]:
        fn = wrap(f)
        return (lambda: fn(x, y)), None

    return make


CASES = (
    *_foundation_cases(),
    Case("one_kernel", "one_kernel", _one_kernel),
    Case("cpu_op_middle", "cpu_op", _cpu_op),
)


def _raw_graph(
    make: Callable[[Callable[[Any], Any]], tuple[Step, Any]], device: torch.device
) -> Step:
    """Capture the Inductor-compiled step once by hand; time ``graph.replay()``."""
    run, _ = make(lambda m: torch.compile(m, backend="inductor"))
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _loom_coverage(first: int) -> str:
    from torchloom import cudagraph_stats

    segs = [s for r in cudagraph_stats()[first:] for s in r.segments]
    captured = sum(s.captured for s in segs)
    replays = sum(s.replays for s in segs)
    return f"{captured}/{len(segs)} captured, {replays} replays"


def _runtime_step(run: Step) -> Step | None:
    """The loom CUDA-graph runtime of ``run``'s one graph, called with the inputs
    AOTAutograd passed it; ``None`` when a step calls more than one runtime."""
    with CudagraphRuntime.record_calls() as calls:
        run()
    if len(calls) != 1:
        return None
    (call,) = calls
    runtime, inputs = call.runtime, call.inputs
    return lambda: runtime(list(inputs))


def measure(case: Case, device: torch.device, quick: bool, iters: int) -> list[dict[str, Any]]:
    from torchloom import cudagraph_stats

    make = case.build(device, quick)
    variants: dict[str, Callable[[], Step]] = {
        "inductor": lambda: make(lambda m: torch.compile(m, backend="inductor"))[0],
        "loom-cg": lambda: make(
            lambda m: torch.compile(m, backend="loom", options={"cudagraphs": True})
        )[0],
    }
    if device.type == "cuda":
        variants["inductor-ro"] = lambda: make(lambda m: torch.compile(m, mode="reduce-overhead"))[
            0
        ]
    warmup = 3 if quick else 10
    rows = []
    # Timed together in interleaved rounds at the end: neither goes through Dynamo,
    # so they outlive the resets between the end-to-end variants.
    floor: dict[str, Step] = {}
    for name, build in variants.items():
        torch._dynamo.reset()
        first = len(cudagraph_stats())
        before = reserved_memory(device)
        try:
            inner = build()

            def run(inner: Step = inner) -> Any:
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
                return inner()

            for _ in range(3):  # compile, warm up, record
                run()
            timing = time_fn(run, warmup=warmup, iters=iters, device=device)
            mem = peak_memory(run, device)
            held = reserved_memory(device)
            row: dict[str, Any] = {"workload": case.name, "variant": name, **timing.as_dict()}
            row["peak_mib"] = None if mem is None else mem / 2**20
            if mem is not None and held is not None and before is not None:
                row["resident_mib"] = (held - before) / 2**20
                row["footprint_mib"] = row["resident_mib"] + row["peak_mib"]
            if name == "loom-cg":
                row["coverage"] = _loom_coverage(first)
                runtime = _runtime_step(run)
                if runtime is not None:
                    floor["loom-cg runtime"] = runtime
            del inner, run  # NOTE: the next variant's baseline excludes this one's pools
        except Exception as exc:  # a failing variant is a row, not a lost run
            row = {"workload": case.name, "variant": name, "error": repr(exc)[:200]}
        print(f"  {case.name:<14} {name:<16} {row.get('median_ms', row.get('error'))}", flush=True)
        rows.append(row)
    torch._dynamo.reset()
    if device.type == "cuda" and case.kind != "cpu_op":
        try:
            floor = {"raw-graph": _raw_graph(make, device), **floor}
        except Exception as exc:
            rows.append({"workload": case.name, "variant": "raw-graph", "error": repr(exc)[:200]})
    rows += _interleaved(case, floor, device, warmup, iters)
    torch._dynamo.reset()
    by = {r["variant"]: r for r in rows}
    loom = by.get("loom-cg", {})
    for r in rows:
        r["vs_raw"] = ratio(r.get("median_ms"), by.get("raw-graph", {}).get("median_ms"))
        r["vs_ro"] = ratio(r.get("median_ms"), by.get("inductor-ro", {}).get("median_ms"))
        r["vs_inductor"] = ratio(r.get("median_ms"), by.get("inductor", {}).get("median_ms"))
    if "peak_mib" in loom and "inductor-ro" in by:
        loom["peak_vs_ro"] = ratio(loom.get("peak_mib"), by["inductor-ro"].get("peak_mib"))
        loom["footprint_vs_ro"] = ratio(
            loom.get("footprint_mib"), by["inductor-ro"].get("footprint_mib")
        )
    return rows


def _interleaved(
    case: Case, steps: dict[str, Step], device: torch.device, warmup: int, iters: int
) -> list[dict[str, Any]]:
    """Time ``steps`` in interleaved rounds (launch-bound steps drift with host noise)."""
    rounds = 5
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for run in steps.values():
        time_fn(run, warmup=warmup, iters=1, device=device)
    for _ in range(rounds):
        for name, run in steps.items():
            samples[name] += time_fn(
                run, warmup=2, iters=max(1, iters // rounds), device=device
            ).times_s
    rows = []
    for name, times in samples.items():
        row = {"workload": case.name, "variant": name, **Timing(tuple(times)).as_dict()}
        print(f"  {case.name:<14} {name:<16} {row['median_ms']}", flush=True)
        rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    kinds = {c.name: c.kind for c in CASES}
    for r in rows:
        if r["variant"] != "loom-cg" or "median_ms" not in r:
            continue
        kind = kinds[r["workload"]]
        raw, ro, ind = r.get("vs_raw"), r.get("vs_ro"), r.get("vs_inductor")
        own = _variant_vs_raw(rows, r["workload"], "loom-cg runtime")
        if kind == "foundation":
            lines.append(
                f"{r['workload']}: loom-cg {_x(raw)} of raw replay "
                f"({_v(raw, FOUNDATION_TARGET_RAW)}), {_x(ro)} of reduce-overhead ({_v(ro, 1.0)}), "
                f"peak memory {_x(r.get('peak_vs_ro'))} and footprint "
                f"{_x(r.get('footprint_vs_ro'))} of reduce-overhead; "
                f"the runtime alone {_x(own)} of raw replay"
            )
        elif kind == "one_kernel":
            lines.append(
                f"{r['workload']}: the runtime alone (loom-cg runtime) {_x(own)} of raw replay "
                f"({_v(own, ONE_KERNEL_TARGET_RAW)}); end to end loom-cg {_x(raw)} of raw replay "
                f"({_v(raw, ONE_KERNEL_TARGET_RAW)}), "
                f"reduce-overhead {_x(_variant_vs_raw(rows, r['workload'], 'inductor-ro'))} "
                "of raw replay"
            )
        else:
            lines.append(
                f"{r['workload']}: loom-cg {_x(ind)} of Inductor ({_v(ind, 1.0)}), "
                f"{_x(ro)} of reduce-overhead ({_v(ro, 1.0)})"
            )
    return lines


def _variant_vs_raw(rows: list[dict[str, Any]], workload: str, variant: str) -> float | None:
    return next(
        (r.get("vs_raw") for r in rows if r["workload"] == workload and r["variant"] == variant),
        None,
    )


def _v(value: float | None, target: float) -> str:
    if value is None:
        return "not measured"
    return f"{'met' if value <= target else 'MISSED'} <= {target}x"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of: {', '.join(c.name for c in CASES)}",
    )
    parser.add_argument(
        "--micro",
        action="store_true",
        help="time the runtime's per-call path on the host with a no-op replay",
    )


# --- --micro: the runtime's per-call path on the host --------------------------------------


class _NoopGraph:
    def replay(self) -> None:
        pass


class _NoopCapturer:
    """Captures by running the segment once; a replay does nothing, so what is
    timed is the runtime's own per-call work (dispatch, checks, copies, aliases)."""

    def new_pool_handle(self) -> Any:
        return object()

    def capture(self, fn: Any, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        return _NoopGraph(), list(fn(list(inputs)))

    def replay(self, graph: Any) -> None:
        graph.replay()

    def replayer(self, graph: Any) -> Callable[[], object]:
        replay: Callable[[], object] = graph.replay
        return replay

    def reserved(self) -> int:
        return 0

    def pool_bytes(self, before: int) -> int:
        return 0


MicroCase = tuple[Callable[..., Any], list[list[torch.Tensor]], tuple[int, ...]]


def _micro_cases() -> dict[str, MicroCase]:
    """``(fn, inputs, static)``: calls cycle through ``inputs`` (two lists: every
    call passes tensors at other addresses than the one before, so they are copied)."""
    x, y, w = torch.randn(1024), torch.randn(1024), torch.randn(1024)
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(6)]
    h = torch.randn(8, 16)

    def mlp(h: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for w in ws:
            h = torch.relu(h @ w)
        return h

    def one(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    return {
        "one_kernel, same input (read in place)": (one, [[x]], ()),
        "one_kernel, input moves (copied)": (one, [[x], [y]], ()),
        "one static input in place + 1 copied": (lambda t, w: t * w, [[x, w], [y, w]], (1,)),
        "6 parameters + 1 same input": (mlp, [[h, *params]], tuple(range(1, 7))),
        "3 outputs, same input": (lambda t: (t + 1, t * 2, t - 1), [[x]], ()),
    }


def _micro_step(run: Callable[[list[Any]], Any], inputs: list[list[torch.Tensor]]) -> Step:
    if len(inputs) == 1:
        (only,) = inputs
        return lambda: run(list(only))
    turn = itertools.cycle(inputs)
    return lambda: run(list(next(turn)))


def micro(module: Any = None, calls: int = 20000, rounds: int = 15) -> list[dict[str, Any]]:
    """Microseconds per call of ``build_runtime``'s callable with a no-op replay,
    beside the same loop calling a bare no-op replay (the floor); ``module`` is
    ``loom_cudagraph`` or another build of it (to compare two versions)."""
    import gc
    import time

    from torch.fx.experimental.proxy_tensor import make_fx

    cg = module or importlib.import_module("loom_cudagraph")
    steps: dict[str, Step] = {"bare replay (floor)": _NoopGraph().replay}
    for name, (fn, inputs, static) in _micro_cases().items():
        gm = make_fx(fn)(*inputs[0])
        plan = cg.plan_graph(
            gm, inputs[0], static, cg.CudagraphOptions(), name=name, device=torch.device("cpu")
        )
        run = cg.build_runtime(plan, gm, example_inputs=inputs[0], capturer=_NoopCapturer())
        steps[name] = _micro_step(run, inputs)
    for run in steps.values():
        for _ in range(10):  # warm-up, record, replays
            run()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, run in steps.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    run()
                samples[name].append((time.perf_counter() - t0) / calls)
    finally:
        gc.enable()
    return [
        {
            "case": name,
            "median_us": Timing(tuple(t)).median_s * 1e6,
            "p10_us": Timing(tuple(t)).p10_s * 1e6,
        }
        for name, t in samples.items()
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "", argv, _configure)
    if args.micro:
        rows = micro()
        print(format_table(rows))
        if not args.no_append:
            notes = "Microseconds per call of the runtime with a replay that does nothing."
            path = append_results(
                "cudagraph", "CUDA-graph runtime per-call path on the host", rows, notes
            )
            print(f"appended to {path}")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    wanted = set(args.workloads.split(",")) if args.workloads else {c.name for c in CASES}
    print(f"cudagraph benchmark on {device}, {args.iters} iterations", flush=True)
    rows: list[dict[str, Any]] = []
    for case in CASES:
        if case.name in wanted:
            rows += measure(case, device, args.quick, args.iters)
    lines = verdicts(rows)
    print()
    print(format_table(rows))
    print()
    print("\n".join(lines))
    if not args.no_append:
        notes = (
            "Median step times (CUDA events per call). raw-graph: the Inductor-compiled step "
            "captured by hand in one torch.cuda.CUDAGraph and replayed. "
            f"{'Quick run. ' if args.quick else ''}\n\n" + "\n".join(f"- {line}" for line in lines)
        )
        path = append_results(
            "cudagraph",
            f"CUDA graphs: loom / reduce-overhead / raw replay on {device}",
            rows,
            notes,
            device=device,
        )
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
