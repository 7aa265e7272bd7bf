"""Where loom's per-graph CUDA graphs differ from reduce-overhead: time and memory.

A diagnosis aid for the GPU machine (not a benchmark: nothing is appended to
``benchmarks/results``). For each Hugging Face workload of ``bench_hf`` it
compiles the model with ``reduce-overhead`` and with loom's CUDA graphs, then
prints, per variant:

- memory: what the variant holds after warm-up beyond its model (pools,
  static outputs), the peak of one warm step above that, and the allocator's
  segments grouped by memory pool;
- time: the Python functions a warm step spends its host time in (cProfile,
  sorted by own time), and loom's ``cudagraph_stats``.

    python scripts/diagnose_parity.py --device cuda [--models gpt2] [--workloads forward_b1]
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import gc
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_hf


def _segments_by_pool(device: torch.device) -> dict[str, int]:
    by_pool: dict[str, int] = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != device.index and device.index is not None:
            continue
        pool = seg.get("segment_pool_id", (0, 0))
        active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        by_pool[f"pool {tuple(pool)} total"] += seg["total_size"]
        by_pool[f"pool {tuple(pool)} active"] += active
    return dict(by_pool)


def _blocks_allocated_since(device: torch.device, before: set[int]) -> list[str]:
    """Active blocks of 1 MiB or more that were not active before, with where
    they were allocated (the innermost frames outside torch's own modules)."""
    lines = []
    snap = torch.cuda.memory._snapshot(device)
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated" or b["address"] in before:
                continue
            if b["size"] < 2**20:
                continue
            frames = [
                f"{f['filename'].rsplit('/', 3)[-1]}:{f['line']}:{f['name']}"
                for f in b.get("frames", [])
                if "python" in f["filename"] or f["filename"].endswith(".py")
            ]
            lines.append(
                f"  {b['size'] / 2**20:7.2f} MiB pool {tuple(seg.get('segment_pool_id', ()))}: "
                + " <- ".join(frames[:6])
            )
    return lines


def _holders(device: torch.device, before: set[int]) -> list[str]:
    """For active blocks of 1 MiB or more made since ``before`` (addresses), the
    Python tensors that view them and what refers to those tensors (two levels)."""
    ranges = []
    for seg in torch.cuda.memory._snapshot(device)["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in before:
                if b["size"] >= 2**20:
                    ranges.append(
                        (b["address"], b["address"] + b["size"], seg.get("segment_pool_id"))
                    )
    lines = []
    found: set[int] = set()
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cuda":
            continue
        try:
            ptr = obj.untyped_storage().data_ptr()
        except Exception:
            continue
        for lo, hi, pool in ranges:
            if lo <= ptr < hi:
                found.add(lo)
                lines.append(f"  tensor {tuple(obj.shape)} {obj.dtype} at {ptr:#x} (pool {pool}):")
                for ref in gc.get_referrers(obj):
                    lines.append(f"    <- {_describe(ref)}")
                    if isinstance(ref, (list, dict, tuple)):
                        for ref2 in gc.get_referrers(ref)[:4]:
                            lines.append(f"       <- {_describe(ref2)}")
    for lo, hi, pool in ranges:
        if lo not in found:
            lines.append(
                f"  block {lo:#x} ({(hi - lo) / 2**20:.1f} MiB, pool {pool}): no Python tensor"
            )
    return lines


def _describe(obj: object) -> str:
    import types

    if isinstance(obj, types.FrameType):
        return (
            f"frame {obj.f_code.co_filename.rsplit('/', 2)[-1]}:{obj.f_lineno} {obj.f_code.co_name}"
        )
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__} of {len(obj)}"
    if isinstance(obj, dict):
        return f"dict keys {list(obj)[:6]}"
    if isinstance(obj, types.CellType):
        return "closure cell"
    return type(obj).__qualname__


def _active_addresses(device: torch.device) -> set[int]:
    return {
        b["address"]
        for seg in torch.cuda.memory_snapshot()
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }


def diagnose(
    model_name: str,
    w: bench_hf.Workload,
    device: torch.device,
    steps: int,
    variants: tuple[str, ...] = ("inductor-ro", "loom-cudagraphs"),
) -> None:
    size = bench_hf.GPU_SIZE
    base = bench_hf.MODELS[model_name](size).to(device).train(w.train)
    ids = torch.randint(0, size.vocab, w.shape(size), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    for v in bench_hf.VARIANTS:
        if v.name not in variants:
            continue
        bench_hf._reset()
        model = copy.deepcopy(base)
        torch.cuda.synchronize()
        gc.collect()
        before = torch.cuda.memory_allocated(device)
        pools_before = _segments_by_pool(device)
        active_before = _active_addresses(device)
        torch.cuda.memory._record_memory_history(max_entries=100000)
        run = bench_hf._runner(w, model, v.wrap(w.fn), ids)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        gc.collect()
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - held
        print(f"\n=== {model_name}_{w.name} / {v.name}")
        print(
            f"resident {(held - before) / 2**20:.2f} MiB, step peak above it {peak / 2**20:.2f} MiB,"
            f" footprint {(held - before + peak) / 2**20:.2f} MiB"
        )
        _print_memory(device, pools_before, active_before, v.name)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            run()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        print(f"  {st.total_calls / steps:.0f} Python calls per step")  # type: ignore[attr-defined]
        st.sort_stats("tottime").print_stats(22)
        print("\n".join(out.getvalue().splitlines()[6:34]))
        del run, model
        bench_hf._reset()
        gc.collect()
        torch.cuda.empty_cache()


def _print_memory(
    device: torch.device, pools_before: dict[str, int], active_before: set[int], variant: str
) -> None:
    """Growth per pool, the active blocks made since ``active_before`` with where they
    were allocated and who holds them; loom's CUDA-graph stats. Ends the history."""
    import torchloom

    for k, val in sorted(_segments_by_pool(device).items()):
        delta = val - pools_before.get(k, 0)
        if delta:
            print(f"  {k}: +{delta / 2**20:.2f} MiB")
    print("  active blocks made since the build:")
    print("\n".join(_blocks_allocated_since(device, active_before)[:30]))
    print("  who holds them:")
    print("\n".join(_holders(device, active_before)[:60]))
    torch.cuda.memory._record_memory_history(enabled=None)
    if variant.startswith("loom"):
        for stats in torchloom.cudagraph_stats():
            print(stats.format())


def diagnose_foundation(name: str, device: torch.device) -> None:
    """The same memory view for a workload of ``bench_cudagraph`` (``--foundation``)."""
    import bench_cudagraph
    from _harness import reserved_memory

    import torchloom

    case = next(c for c in bench_cudagraph.CASES if c.name == name)
    make = case.build(device, False)
    wraps = {
        "inductor-ro": lambda m: torch.compile(m, mode="reduce-overhead"),
        "loom-cudagraphs": lambda m: torch.compile(m, backend="loom", options={"cudagraphs": True}),
    }
    for variant, wrap in wraps.items():
        torch._dynamo.reset()
        torchloom.reset()
        before = reserved_memory(device) or 0
        pools_before = _segments_by_pool(device)
        active_before = _active_addresses(device)
        torch.cuda.memory._record_memory_history(max_entries=100000)
        run = make(wrap)[0]
        for _ in range(5):
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
            run()
        held = reserved_memory(device) or 0
        print(f"\n=== {name} / {variant}: resident {(held - before) / 2**20:.2f} MiB")
        _print_memory(device, pools_before, active_before, variant)
        del run
        gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--workloads", default="train,forward_b1")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--variants", default="inductor-ro,loom-cudagraphs")
    parser.add_argument(
        "--foundation", default=None, help="a bench_cudagraph workload instead (e.g. gpt_train)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.foundation:
        diagnose_foundation(args.foundation, device)
        return 0
    for model_name in args.models.split(","):
        for w in bench_hf.WORKLOADS:
            if w.name in args.workloads.split(","):
                diagnose(model_name, w, device, args.steps, tuple(args.variants.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
