"""Cold vs warm time-to-first-step of the GPT-stack training step, in fresh processes.

Four variants, each a fresh Python process: Inductor cold (empty
TORCHINDUCTOR_CACHE_DIR), Inductor warm (same directory again: FX graph cache
and AOTAutograd cache on), loom cold (empty loom and Inductor caches) and loom
warm (same directories again). Time to first step is measured in the child from
``torch.compile`` to the end of the first training step (forward, loss,
backward, synchronized). The child also reports loom's per-stage costs and the
hit counters, so the table shows what a warm start skips.

    python benchmarks/bench_cache.py --device cpu --quick

``--store`` measures the store itself instead (CPU, no compile): the cost of a
``put`` and of a ``lookup`` hit against the number of entries already stored
(0, 2,000, 20,000; signed with a key, as a fleet runs), the one-time ledger
count of a store first opened at that size, and ``torchloom cache stats`` /
``list`` run in-process and as a fresh ``torchloom`` process (next to a fresh
``python -c "import torch"``)::

    python benchmarks/bench_cache.py --store
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio

_CHILD = "--child"
_STORE_SIZES = (0, 2_000, 20_000)


def _fill(store: Any, n: int, payload: bytes) -> None:
    """``n`` entries written as files with their index lines, as earlier processes'
    puts would have left them (without the fsync of each, to fill 20,000 quickly)."""
    from loom_cache import CacheKey, Entry, KeyComponent, encode_entry

    key = store.config.keys[0] if store.config.keys else None
    for i in range(n):
        entry = Entry(CacheKey("bench", (KeyComponent("graph", f"{i:064x}", "g"),)), payload)
        path = store.path_of(entry.digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_entry(entry, key=key))
        store._index_append(entry)


def _timed_process(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _store_bench(puts: int, lookups: int) -> list[dict[str, Any]]:
    import contextlib
    import io

    from loom_cache import CacheConfig, CacheKey, Entry, KeyComponent, LocalStore, cache_main

    rows: list[dict[str, Any]] = []
    payload = bytes(range(256)) * 16  # 4 KiB
    config = CacheConfig(keys=(b"bench-key-0123456789abcdef",), max_bytes=1 << 40)
    torch_s = _timed_process([sys.executable, "-c", "import torch"])
    for n in _STORE_SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            store = LocalStore(tmp, config=config)
            _fill(store, n, payload)
            new = [
                Entry(
                    CacheKey("bench", (KeyComponent("graph", f"{n + i + 1:064x}", "g"),)), payload
                )
                for i in range(puts + 1)
            ]
            start = time.perf_counter()
            store.put(new[0])  # the ledger counts the store once
            first = time.perf_counter() - start
            put_s = []
            for entry in new[1:]:
                start = time.perf_counter()
                assert store.put(entry).stored
                put_s.append(time.perf_counter() - start)
            hit_s = []
            for entry in (new[1:] * (lookups // puts + 1))[:lookups]:
                start = time.perf_counter()
                assert store.lookup(entry.digest).hit
                hit_s.append(time.perf_counter() - start)
            timings = {}
            for command in ("stats", "list"):
                start = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    cache_main(["--dir", tmp, command], config=config)
                timings[command] = time.perf_counter() - start
            cli = [sys.executable, "-m", "torchloom", "cache", "--dir", tmp, "list"]
            rows.append(
                {
                    "entries": n,
                    "put ms (median)": round(median(put_s) * 1e3, 3),
                    "lookup hit ms (median)": round(median(hit_s) * 1e3, 3),
                    "first put ms (ledger count)": round(first * 1e3, 1),
                    "cache stats s": round(timings["stats"], 3),
                    "cache list s": round(timings["list"], 3),
                    "`torchloom cache list` process s": round(_timed_process(cli), 2),
                    "`import torch` process s": round(torch_s, 2),
                }
            )
            print(rows[-1], flush=True)
    return rows


def _child(backend: str, device: str, quick: bool) -> None:
    t_import = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters
    from workloads import size_for, step, workloads

    import torchloom

    dev = torch.device(device)
    work = next(w for w in workloads() if w.name == "gpt_train")
    model, x = work.build(size_for(dev, quick), dev)
    params = list(model.parameters())
    kwargs: dict[str, Any] = {"backend": backend}
    if backend == "loom":
        kwargs["options"] = {"codegen": "inductor"}
    imported = time.perf_counter() - t_import
    isa = 0.0
    if dev.type == "cpu":
        # Inductor probes the CPU's vector ISAs once per process (it compiles and loads
        # a test library in a fresh interpreter per ISA): a fixed cost that cold and
        # warm starts of both backends pay alike. Measured apart so the table shows it.
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        t_isa = time.perf_counter()
        pick_vec_isa()
        isa = time.perf_counter() - t_isa
    start = time.perf_counter()
    compiled = torch.compile(model, **kwargs)
    step(compiled, params, x, True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    from torch._dynamo.utils import compilation_time_metrics

    backend_s = sum(compilation_time_metrics.get("OutputGraph.call_user_compiler", []))
    compile_s = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    out: dict[str, Any] = {
        "first_step_s": first,
        "import_s": imported,
        "isa_probe_s": isa,
        "backend_s": backend_s,
        "dynamo_s": compile_s - backend_s,
    }
    if backend == "loom":
        rep = torchloom.report()
        cache = [e.kind for e in rep.entries("cache")]
        out["loom_hits"] = cache.count("hit")
        out["loom_lookups"] = cache.count("hit") + cache.count("miss")
        stages: dict[str, float] = {}
        for g in rep:
            for s in g.stages:
                stages[s.name] = stages.get(s.name, 0.0) + s.seconds
        out["stages"] = stages
    out["aot_cache_hit"] = counters["aot_autograd"]["autograd_cache_hit"]
    out["aot_cache_miss"] = counters["aot_autograd"]["autograd_cache_miss"]
    out["fx_cache_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    out["fx_cache_miss"] = counters["inductor"]["fxgraph_cache_miss"]
    print("RESULT " + json.dumps(out))


def _run(backend: str, device: str, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, _CHILD, backend, device, "1" if quick else "0"]
    start = time.perf_counter()
    base = {k: v for k, v in os.environ.items() if k != "TORCHLOOM_REMOTE_CACHE"}
    proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} child failed:\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    result["process_s"] = wall
    return result


def main() -> int:
    def configure(p: Any) -> None:
        p.add_argument(
            "--warm-repeats",
            type=int,
            default=None,
            help="warm processes per backend, median taken (default: 3 on cpu, 1 on cuda)",
        )
        p.add_argument(
            "--store",
            action="store_true",
            help="measure put/lookup/list against the store's size instead (CPU)",
        )

    args = parse_args(__doc__.splitlines()[0], configure=configure)
    if args.store:
        puts = 20 if args.quick else 200
        store_rows = _store_bench(puts, 10 * puts)
        print(format_table(store_rows))
        if not args.no_append:
            notes = (
                f"`python benchmarks/bench_cache.py --store`: the local store (entries of "
                f"4 KiB, signed), {puts} puts and {10 * puts} lookup hits per size, medians. A put "
                "includes its fsync; the first put of a process that opens a store without a "
                "ledger counts the store once. `cache stats`/`list` in-process, then as a fresh "
                "`torchloom cache list` process beside a fresh `import torch`."
            )
            append_results("cache", "store cost vs size (cpu)", store_rows, notes, device="cpu")
        return 0
    if args.warm_repeats is None:
        args.warm_repeats = 1 if args.device == "cuda" else 3
    rows: list[dict[str, Any]] = []
    stage_rows: list[dict[str, Any]] = []
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {
            backend: {
                "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / backend / "inductor"),
                "TORCHLOOM_CACHE_DIR": str(Path(tmp) / backend / "loom"),
                "TRITON_CACHE_DIR": str(Path(tmp) / backend / "triton"),
                "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
            }
            for backend in ("inductor", "loom")
        }
        for backend, env in envs.items():
            results[f"{backend} cold"] = _run(backend, args.device, args.quick, env)
        # Warm processes alternate between the backends, so load on the machine hits both alike.
        warms: dict[str, list[dict[str, Any]]] = {b: [] for b in envs}
        for _ in range(args.warm_repeats):
            for backend, env in envs.items():
                warms[backend].append(_run(backend, args.device, args.quick, env))
    for backend, runs in warms.items():
        warm = dict(runs[0])
        for field in ("first_step_s", "process_s", "isa_probe_s", "backend_s", "dynamo_s"):
            warm[field] = median(r[field] for r in runs)
        results[f"{backend} warm"] = warm
    for name in ("loom cold", "loom warm"):
        res = results[name]
        stage_rows.append({"variant": name, **{k: round(v, 3) for k, v in res["stages"].items()}})
    for name, res in results.items():
        backend = name.split()[0]
        if backend == "loom":
            hits = f"loom {res['loom_hits']}/{res['loom_lookups']}"
        else:
            lookups = res["aot_cache_hit"] + res["aot_cache_miss"]
            fx = res["fx_cache_hit"] + res["fx_cache_miss"]
            hits = f"aot {res['aot_cache_hit']}/{lookups}, fx {res['fx_cache_hit']}/{fx}"
        rows.append(
            {
                "variant": name,
                "first step s": round(res["first_step_s"], 3),
                "dynamo s": round(res["dynamo_s"], 3),
                "backend s": round(res["backend_s"], 3),
                "+ ISA probe s": round(res["isa_probe_s"], 2),
                "process s": round(res["process_s"], 2),
                "vs own cold": ratio(
                    res["first_step_s"], results[f"{backend} cold"]["first_step_s"]
                ),
                "vs inductor warm": ratio(
                    res["first_step_s"], results["inductor warm"]["first_step_s"]
                ),
                "cache hits": hits,
            }
        )
    print(format_table(rows))
    print()
    print(format_table(stage_rows))
    if not args.no_append:
        size = "quick" if args.quick else "default"
        notes = (
            "Time to first training step (compile + first step) of `gpt_train` in fresh "
            "processes; warm = median of the warm processes. On CPU, Inductor's per-process "
            "vector-ISA probe runs before the timer and is shown apart (both backends pay it "
            "in every process, cold or warm). Second table: loom's stage costs (seconds) "
            "inside the backend; Dynamo tracing is the rest of the first step."
        )
        append_results(
            "cache", f"cache cold vs warm ({args.device}, {size})", rows, notes, device=args.device
        )
        append_results(
            "cache", f"loom stage costs ({args.device}, {size})", stage_rows, device=args.device
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        _child(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
        sys.exit(0)
    sys.exit(main())
