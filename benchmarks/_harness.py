"""Shared measuring tools for the ``benchmarks/bench_*.py`` scripts.

Every script measures its variants side by side in one process and reports
medians and ratios; nothing here asserts a time. Timings on CUDA use CUDA
events around each iteration (the device is synchronized before reading them),
on CPU ``time.perf_counter``. Results are appended, dated and with the device
and versions, to ``benchmarks/results/<name>.md`` and copied as JSON to
``$BENCH_OUT/<name>.json`` when that variable is set.

A script imports it from its own folder::

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import append_results, parse_args, time_fn

    args = parse_args("MLP inference")
    t = time_fn(lambda: model(x), warmup=3, iters=args.iters, device=args.device)
    append_results("mlp", "MLP inference", [{"variant": "eager", "median_ms": t.median_ms}])
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Timing",
    "append_results",
    "env_info",
    "format_table",
    "fresh_compile_caches",
    "fresh_inductor_cache",
    "parse_args",
    "peak_memory",
    "ratio",
    "sync",
    "time_fn",
    "time_once",
]

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

DeviceLike = str | torch.device


@dataclasses.dataclass(frozen=True, slots=True)
class Timing:
    """Per-iteration wall times of one measured callable, in seconds."""

    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def p10_s(self) -> float:
        return _quantile(self.times_s, 0.10)

    @property
    def p90_s(self) -> float:
        return _quantile(self.times_s, 0.90)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def p10_ms(self) -> float:
        return self.p10_s * 1e3

    @property
    def p90_ms(self) -> float:
        return self.p90_s * 1e3

    def as_dict(self) -> dict[str, float]:
        """Median, p10 and p90 in milliseconds, ready to merge into a result row."""
        return {"median_ms": self.median_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms}


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty sequence."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _is_cuda(device: DeviceLike) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: DeviceLike) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if _is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 20,
    device: DeviceLike = "cpu",
) -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then time each of ``iters`` calls.

    On CUDA each call is bracketed by CUDA events on the current stream, so the
    time is the device time the call's work took, launch gaps included; the
    events are read after one final synchronize. On CPU each call is timed with
    ``time.perf_counter``. Python's cyclic garbage collector is paused during
    the timed calls (after one collection), as ``timeit`` does.
    """
    if iters < 1:
        raise ValueError(f"time_fn needs iters >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    sync(device)
    # NOTE: as timeit does, keep the cyclic GC out of the timed loop; a compile
    # leaves much garbage, and its collection would land in one variant's steps.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return Timing(tuple(_timed_calls(fn, iters, device)))
    finally:
        if gc_was_enabled:
            gc.enable()


def _timed_calls(fn: Callable[[], object], iters: int, device: DeviceLike) -> list[float]:
    if _is_cuda(device):
        pairs = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        sync(device)
        return [s.elapsed_time(e) / 1e3 for s, e in pairs]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def time_once(fn: Callable[[], object], device: DeviceLike) -> float:
    """Wall seconds of one call, device work included (for compile times)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def peak_memory(fn: Callable[[], object], device: DeviceLike) -> int | None:
    """Peak CUDA bytes allocated during ``fn`` above what was allocated before it.

    Returns ``None`` on CPU: the caching allocator's counters exist only for
    CUDA, and process RSS is too coarse to compare variants.
    """
    if not _is_cuda(device):
        return None
    dev = torch.device(device)
    sync(dev)
    baseline = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    sync(dev)
    return int(torch.cuda.max_memory_allocated(dev) - baseline)


def reserved_memory(device: DeviceLike) -> int | None:
    """CUDA bytes the caching allocator keeps reserved now, after a collection and
    ``empty_cache`` (CUDA-graph pools count whole; ``None`` on CPU).

    cuBLAS's cached per-stream workspaces are dropped first: any matmul outside a
    capture re-creates them, and a capture (CUDA-graph trees', loom's) clears
    them, so whether they exist at a reading depends on which variant ran last,
    not on what the variant being measured holds.
    """
    dev = _settled(device)
    if dev is None:
        return None
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(dev))


def drop_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (tens of MiB each on Hopper,
    allocated through the caching allocator, so they count in
    ``memory_allocated``). A matmul outside a capture re-creates them and a
    capture (CUDA-graph trees', loom's) clears them: read without dropping them
    first, a baseline holds whatever the previously run variant left, and a
    variant that captures can free them below it (a negative peak)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def allocated_baseline(device: DeviceLike) -> int | None:
    """CUDA bytes allocated now, after a collection and with cuBLAS's workspaces
    dropped: the baseline to read a variant's peak against, so the workspaces its
    own steps create count in its peak whichever variant ran before (``None`` on CPU)."""
    dev = _settled(device)
    return None if dev is None else int(torch.cuda.memory_allocated(dev))


def _settled(device: DeviceLike) -> torch.device | None:
    """The CUDA device after a sync, a collection and cuBLAS's workspaces dropped
    (the state every memory reading starts from; ``None`` on CPU)."""
    if not _is_cuda(device):
        return None
    dev = torch.device(device)
    sync(dev)
    gc.collect()
    drop_cublas_workspaces()
    return dev


@contextlib.contextmanager
def fresh_inductor_cache() -> Iterator[str]:
    """Fresh, empty compile caches for cold compiles: Inductor's, Triton's and loom's.

    ``TORCHINDUCTOR_CACHE_DIR`` (with the Triton cache inside it) and
    ``TORCHLOOM_CACHE_DIR`` point into one new temporary directory; Inductor's
    in-memory caches are cleared on entry and exit. A compile inside the block
    is cold for the FX graph cache, the kernel caches and loom's artifact
    cache. Keep the compiled callable's whole measurement inside the block: a
    lazily compiled backward would otherwise compile against the default
    caches. Yields the directory.
    """
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        saved = os.environ.get("TORCHLOOM_CACHE_DIR")
        os.environ["TORCHLOOM_CACHE_DIR"] = os.path.join(root, "torchloom")
        try:
            yield root
        finally:
            if saved is None:
                os.environ.pop("TORCHLOOM_CACHE_DIR", None)
            else:
                os.environ["TORCHLOOM_CACHE_DIR"] = saved


fresh_compile_caches = fresh_inductor_cache


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or ``None`` when either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def env_info(device: DeviceLike | None = None) -> dict[str, Any]:
    """Device name, compute capability, versions and git commit of this run."""
    dev = torch.device(device if device is not None else _default_device())
    info: dict[str, Any] = {
        "device": dev.type,
        "device_name": platform.processor() or platform.machine(),
        "compute_capability": None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": None,
        "git_commit": _git_commit(),
        "platform": platform.platform(),
    }
    if dev.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        info["compute_capability"] = f"{major}.{minor}"
    try:
        import triton  # type: ignore[import-untyped]

        info["triton"] = str(triton.__version__)
    except ImportError:
        pass
    return info


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for row in rows:
        cols.update(dict.fromkeys(row))
    return list(cols)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table; columns are the rows' keys in order of first appearance."""
    if not rows:
        return "(no rows)"
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def append_results(
    name: str,
    title: str,
    rows: list[dict[str, Any]],
    notes: str = "",
    *,
    device: DeviceLike | None = None,
    results_dir: Path | None = None,
) -> Path:
    """Append a dated table with the run's environment to ``results/<name>.md``.

    Also writes a JSON copy to ``$BENCH_OUT/<name>.json`` when ``BENCH_OUT`` is
    set (the GPU script collects that folder). Returns the Markdown path.
    """
    env = env_info(device)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out_dir = results_dir if results_dir is not None else RESULTS_DIR
    path = write_entry(out_dir, name, title, stamp, env, notes, rows)
    bench_out = os.environ.get("BENCH_OUT")
    if bench_out:
        json_path = Path(bench_out) / f"{name}.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        entries: list[Any] = json.loads(json_path.read_text()) if json_path.exists() else []
        entries.append({"title": title, "date": stamp, "env": env, "notes": notes, "rows": rows})
        json_path.write_text(json.dumps(entries, indent=2, default=str) + "\n")
    return path


def write_entry(
    out_dir: Path,
    name: str,
    title: str,
    stamp: str,
    env: dict[str, Any],
    notes: str,
    rows: list[dict[str, Any]],
) -> Path:
    """Append one dated results table to ``out_dir/<name>.md`` (used by
    :func:`append_results` and by ``scripts/import_gpu_results.py`` for tables
    measured on another machine)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    keys = (
        "device",
        "device_name",
        "compute_capability",
        "torch",
        "cuda",
        "triton",
        "python",
        "git_commit",
    )
    env_line = ", ".join(f"{k} {env[k]}" for k in keys if env.get(k) is not None)
    block = [f"## {title} — {stamp}", "", f"_{env_line}_", ""]
    if notes:
        block += [notes.strip(), ""]
    block += [format_table(rows), "", ""]
    header = "" if path.exists() else f"# {name}\n\nAppended by `benchmarks/bench_{name}.py`.\n\n"
    with path.open("a") as fh:
        fh.write(header + "\n".join(block))
    return path


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    configure: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The common command line: ``--device {cpu,cuda}``, ``--quick``, ``--iters N``.

    ``--no-append`` skips writing to ``results/`` (for trial runs); ``configure``
    adds a script's own arguments to the parser.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=_default_device(),
        help="where to run (default: cuda when available)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few iterations (a smoke run)"
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed iterations per variant (default: 10 with --quick, else 50)",
    )
    parser.add_argument(
        "--no-append",
        action="store_true",
        help="print the table without appending to benchmarks/results/",
    )
    if configure is not None:
        configure(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda given but torch.cuda.is_available() is False")
    if args.iters is None:
        args.iters = 10 if args.quick else 50
    return args


if __name__ == "__main__":  # pragma: no cover - a quick self-check
    print(json.dumps(env_info(), indent=2))
    t = time_fn(lambda: torch.ones(256, 256) @ torch.ones(256, 256), iters=5)
    print(format_table([{"op": "matmul 256", **t.as_dict()}]))
    sys.exit(0)
