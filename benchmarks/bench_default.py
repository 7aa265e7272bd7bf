"""The default path's guard: ``backend="loom"`` with no options against ``backend="inductor"``.

One table, on CPU as on GPU, per workload of ``bench_foundation`` and ``bench_hf``
(``workloads.py``: MLP and GPT-stack train and inference; Hugging Face Llama and
GPT-2 built from configs, a causal-LM training step and a batch-1 forward):

- ``step``: loom / Inductor per step; ``step cg``: loom with CUDA graphs
  (``options={"cudagraphs": True}``) / Inductor ``mode="reduce-overhead"`` (CUDA
  only; n/a on CPU). In one process, each variant on its own copy of the model,
  timed in interleaved rounds (the order rotates each round); the ratio is the
  median of the per-round ratios of the rounds' median steps, with the lowest and
  highest per-round ratio as the spread.
- ``cold`` / ``warm``: the first step in a FRESH process, three windows of it.
  ``span``: ``torch.compile`` to the end of the first step, with the imports
  (``torch``, and ``torchloom`` for loom) done before it; ``first call``: the
  first step alone, after ``torch.compile`` returned (``backend="inductor"``
  imports its compiler there; a fixed cost moved between the two shows here);
  ``process``: the whole process as its parent sees it, from its start to its
  exit (interpreter, imports, the model, the span, the compile workers' shutdown).
  Each backend has its own cache directories (``TORCHINDUCTOR_CACHE_DIR``,
  ``TRITON_CACHE_DIR``, ``TORCHLOOM_CACHE_DIR``): empty for each cold run
  (``--cold-runs``, 2 by default, the backends alternating), the first cold run's
  then reused by the warm runs (``--warm-runs``, 5 by default), which alternate
  between the backends too. The ratio is of the medians, the spread the extreme
  pairings (fastest loom / slowest Inductor, slowest loom / fastest Inductor).

On CUDA the first-step windows are wall time. On CPU they are CPU time, the
process's own and its C++ compilers' (Inductor compiles CPU kernels on threads
that wait for each compiler process; no worker process is involved): the
shared 2-core CPU machines run other jobs, which stretch wall time by 2x at
random, not CPU time. CPU steps are timed with ``time.process_time`` on one
intra-op thread, for the same reason.

Bounds (printed as the verdict; ``--check`` exits 1 when one is exceeded, so the
GPU tier logs rather than aborts): on CUDA, the issue's targets with a noise
margin (warm <= 1.00x + 5 %, cold <= 1.05x + 3 %, each window; step and step cg
<= 1.00x + 2 %); on CPU one generous bound, 1.30x, for every ratio but the first
call's (the nox ``bench-default`` session): on a machine without CUDA loom leaves
the import of Inductor's runtime to the first generated module's load, inside the
first call (``torchloom._backend.import_codegen_runtime``)::

    python benchmarks/bench_default.py --device cuda
    python benchmarks/bench_default.py --device cpu --quick --check
    python benchmarks/bench_default.py --device cuda --profile out/   # where first steps go

Results are appended to ``benchmarks/results/default.md`` (and ``$BENCH_OUT``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

_CHILD = "--child"
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

#: (bound, noise margin): a ratio above bound + margin fails.
CUDA_BOUNDS = {
    "step": (1.00, 0.02),
    "step cg": (1.00, 0.02),
    "warm": (1.00, 0.05),
    "cold": (1.05, 0.03),
}
CPU_BOUND = (1.30, 0.0)
#: The workloads ``--quick`` runs (CPU: the nox session stays within a few minutes).
QUICK_WORKLOADS = ("mlp_train",)
QUICK_STEP_WORKLOADS = ("mlp_train",)


# --- the child: one first step in a fresh process ----------------------------------------


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + _children_cpu_seconds()


def _children_cpu_seconds() -> float:
    """CPU time of the child processes waited for so far (and of theirs)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _child(backend: str, workload: str, device: str, quick: bool, profile: str) -> None:
    sys.path.insert(0, str(BENCH_DIR))
    import torch
    from workloads import find, step

    if device == "cpu":
        torch.set_num_threads(1)
    dev = torch.device(device)
    work = find(workload)
    model, x = work.make(dev, quick)
    params = list(model.parameters())
    if device == "cpu":
        # Inductor probes the CPU's vector ISAs once per process (a compile of a test
        # library per ISA): both backends pay it, cold and warm; kept out of the span.
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    if backend == "loom":
        # Imported before the span, as ``torch`` is (the ``process`` window counts it).
        import torchloom
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    compiled = torch.compile(model, backend=backend)
    wall1, cpu1 = time.perf_counter(), _cpu_seconds()
    step(compiled, params, x, work.train)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall2, cpu2 = time.perf_counter(), _cpu_seconds()
    if prof is not None:
        prof.disable()
        _write_profile(prof, Path(profile))
    out: dict[str, Any] = {
        "span": {"wall": wall2 - wall0, "cpu": cpu2 - cpu0},
        "first call": {"wall": wall2 - wall1, "cpu": cpu2 - cpu1},
    }
    if backend == "loom":
        import torchloom

        report = torchloom.report()
        kinds = [e.kind for e in report.entries("cache")]
        out["cache"] = f"loom {kinds.count('hit')} hit / {kinds.count('miss')} miss"
        # Where the backend's time went, per stage over the graphs (loom's and PyTorch's).
        stages: dict[str, float] = {}
        for graph in report:
            for st in graph.stages:
                stages[f"{st.owner}:{st.name}"] = (
                    stages.get(f"{st.owner}:{st.name}", 0.0) + st.seconds
                )
        out["stages"] = {k: round(v, 3) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])}
    else:
        from torch._dynamo.utils import counters

        out["cache"] = (
            f"aot {counters['aot_autograd']['autograd_cache_hit']} hit, "
            f"fx {counters['inductor']['fxgraph_cache_hit']} hit"
        )
    if os.environ.get("BENCH_DEFAULT_STAGES"):
        # PyTorch's own timed sections (both backends), to compare where each spent
        from torch._dynamo.utils import compilation_time_metrics

        spent = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
        out["torch_times"] = dict(sorted(spent.items(), key=lambda kv: -kv[1])[:25])
        from torch._dynamo.utils import counters

        out["torch_counters"] = {
            f"{group}.{name}": n
            for group in ("inductor", "aot_autograd")
            for name, n in sorted(counters[group].items())
            if any(t in name for t in ("cache", "bundler", "static", "kernel"))
        }
    print("RESULT " + json.dumps(out), flush=True)


_TORCH_PATHS = (
    r"(_inductor/(codecache|async_compile|triton_bundler|compile_fx|output_code|graph)"
    r"|_inductor/runtime/(triton_heuristics|static_cuda_launcher)|_aot_autograd/"
    r"|_functorch/aot_autograd)"
)


def _write_profile(prof: Any, path: Path, top: int = 40) -> None:
    """The top entries by cumulative time, then loom's own, with paths made relative."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
    stats.print_stats(top)
    print("loom's own functions (packages/), by cumulative time:", file=text)
    stats.print_stats(r"/packages/\w+/src/", 25)
    # Where a compiled graph is made or loaded (codegen, module and kernel loads,
    # AOTAutograd's cache entry), for both backends.
    print("PyTorch's compile and load path, by cumulative time:", file=text)
    stats.print_stats(_TORCH_PATHS, 40)
    out = re.sub(r"\S*/site-packages/", "", text.getvalue())
    out = re.sub(r"\S*/(packages|benchmarks)/", r"\1/", out)
    out = re.sub(r"/\S*/(lib/python3\.\d+/)", r"\1", out)
    out = re.sub(r"\S*(/inductor/|/torchinductor_\S+?/)", "<inductor cache>/", out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out)


# --- the parent ------------------------------------------------------------------------------


#: The windows of a first step each fresh process reports (see the module's docstring).
WINDOWS = ("span", "first call", "process")


@dataclasses.dataclass(frozen=True, slots=True)
class FirstStep:
    """One fresh process's windows (seconds: wall on CUDA, CPU on CPU) and its cache line."""

    windows: dict[str, float]
    cache: str

    @property
    def seconds(self) -> float:
        return self.windows["span"]


def _run_child(
    backend: str, workload: str, device: str, quick: bool, caches: Path, profile: str
) -> FirstStep:
    # The default path as a user has it: none of the caller's TORCHLOOM_* settings
    # (the GPU tier exports TORCHLOOM_CHECKS=1 for its tests).
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHLOOM_")}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
        TORCHLOOM_CACHE_DIR=str(caches / "loom"),
    )
    cmd = [sys.executable, __file__, _CHILD, backend, workload, device, str(int(quick)), profile]
    cpu0, wall0 = _children_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    process = {"wall": time.perf_counter() - wall0, "cpu": _children_cpu_seconds() - cpu0}
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} {workload} child failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line.removeprefix("RESULT "))
    clock = "wall" if device == "cuda" else "cpu"
    windows = {w: float(({**res, "process": process})[w][clock]) for w in WINDOWS}
    if os.environ.get("BENCH_DEFAULT_STAGES"):
        for field in ("stages", "torch_times", "torch_counters"):
            if res.get(field):
                print(f"    {backend} {field}: {json.dumps(res[field])}", flush=True)
    return FirstStep(windows, str(res["cache"]))


def first_steps(
    workload: str,
    device: str,
    quick: bool,
    warm_runs: int,
    root: Path,
    profile: Path | None = None,
    cold_runs: int = 1,
) -> dict[str, dict[str, list[FirstStep]]]:
    """Cold then warm first steps of both backends, each in a fresh process.

    Cold run ``i`` compiles on empty caches of its own (``root/<backend>`` for the
    first, which the warm runs then reuse; ``root/cold<i>/<backend>`` for the
    others). With ``profile``, the processes run under cProfile and write their
    top entries there (their times are not comparable)."""
    out: dict[str, dict[str, list[FirstStep]]] = {"cold": {}, "warm": {}}
    backends = ("inductor", "loom")
    for phase, runs in (("cold", cold_runs), ("warm", warm_runs)):
        for i in range(runs):
            # Alternate which backend goes first, so drift on the machine hits both.
            for backend in backends if i % 2 == 0 else backends[::-1]:
                prof = ""
                if profile is not None:
                    prof = str(profile / f"profile_{phase}_{backend}_{workload}.txt")
                caches = (
                    root / backend if phase == "warm" or i == 0 else root / f"cold{i}" / backend
                )
                result = _run_child(backend, workload, device, quick, caches, prof)
                out[phase].setdefault(backend, []).append(result)
                shown = ", ".join(f"{w} {result.windows[w]:.3f}" for w in WINDOWS)
                print(f"  {workload} {phase} {backend} (s): {shown}", flush=True)
    return out


@contextlib.contextmanager
def _cache_dirs(root: Path | None) -> Iterator[None]:
    """A variant's own cache directories for the compile inside (``None``: fresh ones)."""
    from _harness import fresh_inductor_cache

    if root is None:
        with fresh_inductor_cache():
            yield
        return
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHLOOM_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in names}
    dirs = (str(root / d) for d in ("inductor", "triton", "loom"))
    os.environ.update(zip(names, dirs, strict=True))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass(frozen=True, slots=True)
class StepVariant:
    name: str
    backend: str
    options: dict[str, Any] | None = None
    mode: str | None = None


STEP_PAIRS: dict[str, tuple[StepVariant, StepVariant]] = {
    "step": (StepVariant("inductor", "inductor"), StepVariant("loom", "loom")),
    "step cg": (
        StepVariant("inductor-ro", "inductor", mode="reduce-overhead"),
        StepVariant("loom-cg", "loom", options={"cudagraphs": True}),
    ),
}


def per_step(
    workload: str,
    device: str,
    quick: bool,
    rounds: int,
    iters: int,
    pairs: Sequence[str],
    caches: Mapping[str, Path],
) -> dict[str, tuple[float, float, float, float, float]]:
    """For each pair: (reference ms, loom ms, ratio median, ratio min, ratio max).

    A variant whose backend has a directory in ``caches`` compiles on it (warm,
    after the first steps: the CUDA-graph variants reuse their backend's kernels),
    the others on fresh ones."""
    import torch
    from workloads import find, step

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    work = find(workload)
    base, x = work.make(dev, quick)
    runners: dict[str, Callable[[], Any]] = {}
    keep: list[Any] = []
    for pair in pairs:
        for v in STEP_PAIRS[pair]:
            model = copy.deepcopy(base)
            params = list(model.parameters())
            kwargs: dict[str, Any] = {"backend": v.backend}
            if v.options is not None:
                kwargs["options"] = v.options
            if v.mode is not None:
                kwargs["mode"] = v.mode
            fn = torch.compile(model, **kwargs)

            def run(fn: Any = fn, params: list[Any] = params) -> Any:
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
                return step(fn, params, x, work.train)

            with _cache_dirs(caches.get(v.backend)):
                for _ in range(3):
                    run()
            runners[v.name] = run
            keep.append((model, fn))
    names = list(runners)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = runners[name]
            times = []
            for _ in range(iters):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = clock()
                run()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(clock() - t0)
            per_round[name].append(statistics.median(times))
    out = {}
    for pair in pairs:
        ref, loom = (v.name for v in STEP_PAIRS[pair])
        ratios = [a / b for a, b in zip(per_round[loom], per_round[ref], strict=True)]
        out[pair] = (
            statistics.median(per_round[ref]) * 1e3,
            statistics.median(per_round[loom]) * 1e3,
            statistics.median(ratios),
            min(ratios),
            max(ratios),
        )
    return out


def _verdict(metric: str, ratio: float, device: str) -> tuple[str, bool] | None:
    """The bound of ``metric`` (``step``, ``step cg``, ``warm <window>``, ``cold <window>``)
    and whether ``ratio`` is within it; ``None`` where no bound applies."""
    if device != "cuda" and metric.endswith("first call"):
        return None  # see the module's docstring: a move on CPU, not a cost
    bound, margin = CUDA_BOUNDS[metric.split()[0]] if device == "cuda" else CPU_BOUND
    ok = ratio <= bound + margin
    text = f"<= {bound:.2f}" + (f" (+{margin:.2f} noise)" if margin else "")
    return text, ok


def main() -> int:
    sys.path.insert(0, str(BENCH_DIR))
    from _harness import append_results, format_table, parse_args

    def configure(p: Any) -> None:
        p.add_argument("--check", action="store_true", help="exit 1 when a ratio is over its bound")
        p.add_argument("--workloads", default=None, help="comma-separated subset")
        p.add_argument("--rounds", type=int, default=None, help="interleaved step rounds")
        p.add_argument("--warm-runs", type=int, default=None, help="warm processes per backend")
        p.add_argument("--cold-runs", type=int, default=None, help="cold processes per backend")
        p.add_argument("--no-first-step", action="store_true", help="per-step ratios only")
        p.add_argument("--no-steps", action="store_true", help="first-step ratios only")
        p.add_argument(
            "--profile",
            type=Path,
            default=None,
            help="instead of the table: profile one cold and one warm first step per backend "
            "and write their top entries by cumulative time here",
        )

    args = parse_args(__doc__.splitlines()[0], configure=configure)
    device, quick = args.device, args.quick
    from workloads import hf_workloads, workloads

    every = [w.name for w in workloads() + hf_workloads()]
    if args.workloads:
        names = args.workloads.split(",")
        first_names, step_names = names, names
    elif quick:
        first_names, step_names = list(QUICK_WORKLOADS), list(QUICK_STEP_WORKLOADS)
    else:
        first_names, step_names = every, every
    if args.profile is not None:
        for name in first_names:
            with tempfile.TemporaryDirectory(prefix="bench-default-") as tmp:
                first_steps(name, device, quick, 1, Path(tmp), args.profile)
        print(f"profiles written to {args.profile}")
        return 0
    if args.no_first_step:
        first_names = []
    if args.no_steps:
        step_names = []
    rounds = args.rounds or (5 if quick else 7)
    iters = args.iters or (10 if quick else 30)
    warm_runs = args.warm_runs or (2 if quick else 5)
    cold_runs = args.cold_runs or (1 if quick else 2)
    pairs = ("step", "step cg") if device == "cuda" else ("step",)

    rows: list[dict[str, Any]] = []
    failed: list[str] = []

    def add(
        workload: str, metric: str, ref: float | None, loom: float | None, **extra: Any
    ) -> None:
        ratio = extra.pop("ratio", None)
        if ratio is None and ref and loom is not None:
            ratio = loom / ref
        row: dict[str, Any] = {"workload": workload, "metric": metric}
        row.update(reference=ref, loom=loom, ratio=ratio, **extra)
        verdict = _verdict(metric.split(" (")[0], ratio, device) if ratio is not None else None
        if verdict is not None:
            row["bound"], ok = verdict
            row["verdict"] = "ok" if ok else "OVER"
            if not ok:
                failed.append(f"{workload} {metric} {ratio:.3f}x")
        rows.append(row)

    unit = "s wall" if device == "cuda" else "s cpu"
    for name in dict.fromkeys(first_names + step_names):
        with tempfile.TemporaryDirectory(prefix="bench-default-") as tmp:
            root = Path(tmp)
            if name in first_names:
                print(f"{name}: first steps in fresh processes", flush=True)
                runs = first_steps(name, device, quick, warm_runs, root, cold_runs=cold_runs)
                for phase in ("cold", "warm"):
                    for window in WINDOWS:
                        ind = [r.windows[window] for r in runs[phase]["inductor"]]
                        loom = [r.windows[window] for r in runs[phase]["loom"]]
                        spread = None
                        if len(ind) > 1:
                            pairings = ((min(loom), max(ind)), (max(loom), min(ind)))
                            spread = "-".join(f"{a / b:.3f}" for a, b in pairings)
                        add(
                            name,
                            f"{phase} {window} ({unit})",
                            statistics.median(ind),
                            statistics.median(loom),
                            spread=spread,
                            cache=runs[phase]["loom"][-1].cache,
                        )
            if name in step_names:
                print(f"{name}: per step, {rounds} interleaved rounds of {iters}", flush=True)
                caches = {b: root / b for b in ("inductor", "loom") if name in first_names}
                steps = per_step(name, device, quick, rounds, iters, pairs, caches)
                for pair, (ref, loom_ms, med, lo, hi) in steps.items():
                    label = "step (ms)" if pair == "step" else "step cg (ms, vs RO)"
                    add(name, label, ref, loom_ms, ratio=med, spread=f"{lo:.3f}-{hi:.3f}")
                if device != "cuda":
                    add(name, "step cg", None, None, spread="n/a on cpu")
        # NOTE: printed per workload, so a run cut short keeps what it measured.
        print(format_table([r for r in rows if r["workload"] == name]), flush=True)
    print(format_table(rows))
    verdict = "all within bounds" if not failed else "OVER: " + "; ".join(failed)
    print(f"verdict: {verdict}")
    if not args.no_append:
        size = "quick" if quick else "default"
        notes = (
            f'`backend="loom"` (no options) / `backend="inductor"`; `step cg`: loom '
            f"`cudagraphs` / Inductor reduce-overhead. Steps: {rounds} interleaved rounds of "
            f"{iters}, ratio = median of per-round ratios, spread = lowest-highest per-round "
            f"ratio. First steps: fresh processes, cold ({cold_runs} per backend, alternating) "
            "on empty per-backend caches, warm "
            f"({warm_runs} per backend, alternating) on the caches the cold run filled; "
            "windows: span = torch.compile to the end of the first step (imports before it), "
            "first call = the first step alone, process = the whole process; "
            f"spread = extreme pairings. {unit}. Verdict: {verdict}."
        )
        append_results(
            "default", f"default path vs Inductor ({device}, {size})", rows, notes, device=device
        )
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        backend, workload, device, quick, profile = sys.argv[2:7]
        _child(backend, workload, device, quick == "1", profile)
        sys.exit(0)
    sys.exit(main())
