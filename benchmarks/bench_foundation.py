"""Eager, Inductor, Inductor ``reduce-overhead`` and loom, side by side in one process.

For each workload (batch-8 MLP inference, MLP and GPT-stack training steps,
batch-1 GPT inference) every variant gets a fresh copy of the same model, a
fresh Dynamo state and a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, so its first
call is a cold compile. The first call's wall time is the compile time; then
the step is checked against eager and timed. The table reports medians and
the ratios of step time and compile time to Inductor's, and is appended to
``benchmarks/results/foundation.md``.

Targets of the foundation issue (GPU workloads): loom's default step time
within 1.05x of Inductor's and its compile time within 1.2x.

    python benchmarks/bench_foundation.py --device cuda
    python benchmarks/bench_foundation.py --device cpu --quick --no-append
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import hashlib
import os
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    Timing,
    append_results,
    format_table,
    fresh_inductor_cache,
    parse_args,
    peak_memory,
    ratio,
    time_fn,
    time_once,
)
from workloads import Workload, size_for, step, workloads

STEP_TARGET = 1.05
ROUNDS = 10
COMPILE_TARGET = 1.2


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    wrap: Callable[[nn.Module], Callable[..., Any]]
    compiled: bool = True
    cuda_only: bool = False


VARIANTS = (
    Variant("eager", lambda m: m, compiled=False),
    Variant("inductor", lambda m: torch.compile(m, backend="inductor")),
    Variant("inductor-ro", lambda m: torch.compile(m, mode="reduce-overhead"), cuda_only=True),
    Variant("loom", lambda m: torch.compile(m, backend="loom")),
)


def _fx_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _loom_cache_counts() -> str | None:
    """loom's own cache lookups since the last ``torchloom.reset()`` (None without loom)."""
    try:
        import torchloom
    except ImportError:
        return None
    kinds = [e.kind for e in torchloom.report().entries("cache")]
    return ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))) or "none"


def _inductor_wrappers(cache_dir: str) -> str | None:
    """Content hashes of the Inductor wrapper modules (those with a ``call``) loaded so far
    in this fresh cache, the cache directory's path and the AOT id comment left out:
    equal hashes mean two variants run the very same generated code."""
    from torch._inductor.codecache import PyCodeCache

    hashes = set()
    for mod in PyCodeCache.modules:
        path = getattr(mod, "__file__", None)
        if path and callable(getattr(mod, "call", None)) and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().replace(cache_dir, "<cache>").splitlines()
            src = "\n".join(line for line in lines if not line.startswith("# AOT ID"))
            hashes.add(hashlib.sha256(src.encode()).hexdigest()[:8])
    return " ".join(sorted(hashes)) or None


def _python_calls_per_step(run: Callable[[], torch.Tensor], steps: int = 20) -> float:
    """Python-level function calls per step (cProfile's count): the host overhead of a
    variant, free of the timing noise a shared host adds to launch-bound steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        run()
    prof.disable()
    return pstats.Stats(prof).total_calls / steps  # type: ignore[attr-defined,no-any-return]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _reset_loom_report() -> None:
    try:
        import torchloom
    except ImportError:
        return
    torchloom.reset()


def _warm_process(device: torch.device) -> None:
    """Pay the one-time costs (imports, worker pools, CUDA context) before timing compiles."""
    with fresh_inductor_cache():
        torch._dynamo.reset()
        f = torch.compile(lambda x: torch.relu(x @ x) + 1.0, backend="inductor")
        torch.autograd.backward(f(torch.randn(16, 16, device=device, requires_grad=True)).sum())
        torch._dynamo.reset()


def _measure(
    w: Workload,
    v: Variant,
    model: nn.Module,
    x: torch.Tensor,
    ref: torch.Tensor,
    device: torch.device,
    warmup: int,
    runners: dict[str, Callable[[], torch.Tensor]],
    cache_dir: str,
) -> dict[str, Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    fn = v.wrap(model)

    def run() -> torch.Tensor:
        # NOTE: a training step must not reuse the previous step's CUDA-graph
        # outputs; marking each step is a no-op for every other variant.
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        return step(fn, params, x, w.train)

    _reset_loom_report()
    hits0, misses0 = _fx_cache_counts()
    compile_s = time_once(run, device) if v.compiled else None
    hits, misses = (a - b for a, b in zip(_fx_cache_counts(), (hits0, misses0), strict=True))
    diff = _max_diff(run().clone(), ref)
    time_fn(run, warmup=warmup, iters=1, device=device)  # warm-up only; timed interleaved
    mem = peak_memory(run, device)
    calls = _python_calls_per_step(run)
    runners[v.name] = run
    return {
        "workload": w.name,
        "variant": v.name,
        "compile_s": compile_s,
        "fx_cache": f"{hits} hit / {misses} miss" if v.compiled else None,
        "loom_cache": _loom_cache_counts() if v.name.startswith("loom") else None,
        "peak_mib": None if mem is None else mem / 2**20,
        "max_abs_diff": diff,
        "py_calls": calls,
        "inductor_code": _inductor_wrappers(cache_dir) if v.compiled else None,
    }


def run_workload(
    w: Workload, variants: tuple[Variant, ...], device: torch.device, quick: bool, iters: int
) -> list[dict[str, Any]]:
    size = size_for(device, quick)
    base, x = w.build(size, device)
    ref = step(base, [p for p in base.parameters()], x, w.train).clone()
    rows = []
    runners: dict[str, Callable[[], torch.Tensor]] = {}
    models = []  # keep every variant's model (and its compiled code) alive for the timing
    torch._dynamo.reset()
    for v in variants:
        model = copy.deepcopy(base)
        models.append(model)
        with fresh_inductor_cache() as cache_dir:
            try:
                row = _measure(w, v, model, x, ref, device, 3 if quick else 10, runners, cache_dir)
            except Exception as exc:  # a failing variant is a row, not a lost run
                row = {"workload": w.name, "variant": v.name, "error": repr(exc)[:200]}
        rows.append(row)
    # NOTE: launch-bound steps drift with host noise over a run; timing the
    # variants in interleaved rounds gives each the same conditions.
    # The ratio to Inductor is the median of per-round ratios, so a burst of
    # host noise that hits one round moves one sample, not the verdict.
    samples: dict[str, list[float]] = {name: [] for name in runners}
    round_medians: dict[str, list[float]] = {name: [] for name in runners}
    rounds = ROUNDS
    order = list(runners.items())
    for rnd in range(rounds):
        # NOTE: the order rotates each round: a variant timed right after a
        # CUDA-graph variant (reduce-overhead) runs slower on a launch-bound step.
        for name, run in order[rnd % len(order) :] + order[: rnd % len(order)]:
            times = time_fn(run, warmup=2, iters=max(1, iters // rounds), device=device).times_s
            samples[name] += times
            round_medians[name].append(statistics.median(times))
    for i, row in enumerate(rows):
        if row["variant"] in samples:
            head = {k: row[k] for k in ("workload", "variant")}
            timing = Timing(tuple(samples[row["variant"]])).as_dict()
            rows[i] = row = {**head, **timing, **{k: v for k, v in row.items() if k not in head}}
        print(f"  {w.name:<14} {row['variant']:<12} {_brief(row)}", flush=True)
    torch._dynamo.reset()
    ind = next((r for r in rows if r["variant"] == "inductor" and "median_ms" in r), None)
    for r in rows:
        own, ind_rounds = round_medians.get(r["variant"]), round_medians.get("inductor")
        r["step_vs_inductor"] = (
            statistics.median(a / b for a, b in zip(own, ind_rounds, strict=True))
            if own and ind_rounds
            else None
        )
        r["compile_vs_inductor"] = ratio(r.get("compile_s"), ind["compile_s"] if ind else None)
        r["calls_vs_inductor"] = ratio(r.get("py_calls"), ind["py_calls"] if ind else None)
    return rows


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"ERROR {row['error']}"
    comp = f"compile {row['compile_s']:.1f} s" if row["compile_s"] is not None else ""
    return f"{row['median_ms']:.3f} ms  {comp}"


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        if r["variant"] != "loom":
            continue
        s, c = r.get("step_vs_inductor"), r.get("compile_vs_inductor")
        ind = next(
            (i for i in rows if i["workload"] == r["workload"] and i["variant"] == "inductor"),
            {},
        )
        same = r.get("inductor_code") is not None and r.get("inductor_code") == ind.get(
            "inductor_code"
        )
        lines.append(
            f"{r['workload']}: loom step {_x(s)} of Inductor ({_verdict(s, STEP_TARGET)}), "
            f"compile {_x(c)} ({_verdict(c, COMPILE_TARGET)}); "
            f"Python calls per step {_x(r.get('calls_vs_inductor'))}; "
            f"{'the same' if same else 'different'} Inductor wrapper code"
        )
    return lines


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "not measured"
    return f"{'met' if value <= target else 'MISSED'} <= {target}x"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _configure(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(w.name for w in workloads())
    parser.add_argument("--workloads", default=None, help=f"comma-separated subset of: {names}")
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of: {', '.join(v.name for v in VARIANTS)}",
    )


def _pick(all_names: list[str], wanted: str | None, what: str) -> set[str]:
    if wanted is None:
        return set(all_names)
    picked = {n.strip() for n in wanted.split(",") if n.strip()}
    unknown = picked - set(all_names)
    if unknown:
        raise SystemExit(f"unknown {what}: {sorted(unknown)}; known: {all_names}")
    return picked


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "", argv, _configure)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    wanted_v = _pick([v.name for v in VARIANTS], args.variants, "variants") | {"eager"}
    wanted_w = _pick([w.name for w in workloads()], args.workloads, "workloads")
    variants = tuple(
        v for v in VARIANTS if v.name in wanted_v and (device.type == "cuda" or not v.cuda_only)
    )
    size = size_for(device, args.quick)
    print(f"foundation benchmark on {device} with {size}, {args.iters} iterations", flush=True)
    _warm_process(device)
    rows: list[dict[str, Any]] = []
    for w in workloads():
        if w.name not in wanted_w:
            continue
        rows += run_workload(w, variants, device, args.quick, args.iters)
    verdicts = _verdicts(rows)
    print()
    print(format_table(rows))
    print()
    print("\n".join(verdicts))
    if not args.no_append:
        notes = (
            f"Sizes: {size}. Compile = first call's wall time (a cold compile: each variant "
            "runs with a fresh, empty TORCHINDUCTOR_CACHE_DIR and a reset Dynamo; "
            "`fx_cache` counts Inductor FX-graph-cache lookups during it, `loom_cache` loom's "
            "own cache lookups; both caches start empty). "
            f"Ratios are to Inductor; the step ratio is the median of {ROUNDS} interleaved "
            "rounds' ratios, `py_calls` the Python function calls per step (cProfile), "
            f"`inductor_code` a content hash of the Inductor wrapper modules the variant runs.{' Quick run.' if args.quick else ''}\n\n"
            + "\n".join(f"- {line}" for line in verdicts)
        )
        path = append_results(
            "foundation",
            f"Foundation: eager / Inductor / loom on {device}",
            rows,
            notes,
            device=device,
        )
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
