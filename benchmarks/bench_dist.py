"""Distributed training steps: a Hugging Face decoder under DDP and FSDP2, per variant.

Launch with ``torchrun``, once per world size (every rank runs the same variants in
the same order; rank 0 prints and appends)::

    torchrun --nproc-per-node 1 benchmarks/bench_dist.py --json dist_w1.json
    torchrun --nproc-per-node 2 benchmarks/bench_dist.py --json dist_w2.json
    torchrun --nproc-per-node 4 benchmarks/bench_dist.py --json dist_w4.json
    python benchmarks/bench_dist.py --combine dist_w1.json dist_w2.json dist_w4.json
    # CPU/gloo smoke (tiny sizes, 2 steps, prints only; about a minute on 2 cores):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/bench_dist.py --device cpu --no-append

The model: ``transformers.LlamaForCausalLM`` built from a config (random weights,
nothing downloaded; 4 layers, hidden 256 on CUDA) inside a root that returns the
causal-LM loss alone (``workloads.CausalLMLoss``). Engines
(``--engine``): ``ddp`` (``DistributedDataParallel``, default buckets) and ``fsdp2``
(``fully_shard`` per decoder layer, then the root). Each step is ``zero_grad``,
forward, backward, ``AdamW(capturable=True)`` step, on a fixed per-rank batch
(``--batch`` sequences of ``--seq`` tokens per GPU: weak scaling). Variants
(``--variants``):

- ``eager``; ``inductor`` (``torch.compile(m)``); ``reduce-overhead``
  (``mode="reduce-overhead"``); ``loom`` (``backend="loom"``); ``loom-cg``
  (``backend="loom", options={"cudagraphs": True}``); the compiled module is the
  DDP module, or the FSDP2 root;
- ``capture_step``: ``torchloom.capture_step`` over the whole eager step (DDP built
  on a side stream, as PyTorch's recipe says; 11 warm-up calls); under FSDP2 it is
  not run unless ``--fsdp2-capture-step`` (capture_step handles FSDP2 steps, but
  until ``dist_check.py --config fsdp2-step`` has passed on GPUs the row says so).

Every variant gets its own model copy (same seed), runs ``--warmup`` calls (its
compile in the first: ``first_call_s``, with loom's cache in a fresh directory and
Inductor's caches as they are), then ``peak_mib``: ``torch.cuda.max_memory_allocated``
over ``--mem-steps`` steps above what was allocated before the variant was built,
read after a collection with cuBLAS's cached workspaces dropped (so the peak holds
the variant's parameters, gradients, optimizer state, graph pools' live tensors and
the cuBLAS workspaces its own steps create, the same way for every variant: read
with the workspaces an earlier variant left, a variant that captures CUDA graphs
cleared them below the baseline and read negative), the largest over the ranks
(``peak_mib_ranks`` lists each); and ``peak_reserved_mib``, the same with
``max_memory_reserved`` above what was reserved then (after ``empty_cache``). A CUDA
graph's intermediates live in its private pool, which the allocator counts as
reserved but, after the capture, not as allocated (a replay writes them without
allocating), so ``peak_mib`` leaves them out for ``reduce-overhead``, ``loom-cg``
and ``capture_step``; ``peak_reserved_mib`` counts them (and the caching
allocator's slack, for every variant). Then every live variant is
timed in ``--rounds`` interleaved rounds (the order rotates each round) of
``--steps`` steps: a round's step time is its wall time over its steps after a
barrier, device synchronized, on the slowest rank; ``step_ms`` is the median over
rounds, ``tokens_s_per_gpu`` = batch x seq / step time, ``vs_eager`` and
``vs_reference`` (loom against inductor, loom-cg against reduce-overhead) are the
medians of per-round ratios (below 1 is faster). ``first_loss_diff`` compares the
first step's loss with eager's. A variant that fails on any rank (its build, its
first calls or a round) is a row with the error's class and first line, and is
dropped on every rank; the others go on. (A rank that fails while another waits in
a collective can only be freed by the process group's timeout, ``--pg-timeout``.)

``--combine`` (no torchrun) reads the ``--json`` files of runs at several world
sizes and prints, per engine and variant, tokens/s per GPU at each size and the
scaling efficiency: tokens/s/GPU at N / at the smallest size given (1 GPU). Rows
are appended to ``benchmarks/results/dist.md`` unless ``--no-append``.

On CPU (``--device cpu``, gloo): tiny sizes, 2 steps per round, 2 rounds; loom runs
with ``codegen="eager"``; ``inductor`` is not run (an Inductor CPU compile takes
minutes on a small machine), ``reduce-overhead`` and ``loom-cg`` are GPU only, and
capture_step runs the step uncaptured. It checks the harness, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import workloads
from _harness import allocated_baseline, append_results, format_table, ratio
from workloads import CausalLMLoss, HFSize

ENGINES = ("ddp", "fsdp2")
VARIANTS = ("eager", "inductor", "reduce-overhead", "loom", "loom-cg", "capture_step")
#: The reference each compiled variant is compared with besides eager.
REFERENCE = {"loom": "inductor", "loom-cg": "reduce-overhead", "capture_step": "eager"}


#: Llama sizes (``workloads.HFSize``; ``window`` unused: training steps only).
GPU_SIZE = HFSize(4, 256, 4, 2, 704, 8192, batch=8, seq=256, window=1)
CPU_SIZE = HFSize(2, 32, 4, 2, 64, 128, batch=2, seq=8, window=1)


def build_llama(size: HFSize) -> CausalLMLoss:
    """The Llama of ``workloads.build_llama``, returning its loss alone (FSDP2 then
    hooks one tensor, not every field of the model's output)."""
    return CausalLMLoss(workloads.build_llama(size))


@dataclasses.dataclass
class Built:
    step: Callable[[torch.Tensor], torch.Tensor]
    keep: list[Any]  # the model, optimizer and compiled module, alive while timed


def _compile_kwargs(variant: str, cuda: bool) -> dict[str, Any] | None:
    loom_options = {} if cuda else {"codegen": "eager"}
    return {
        "eager": None,
        "capture_step": None,
        "inductor": {"backend": "inductor"},
        "reduce-overhead": {"backend": "inductor", "mode": "reduce-overhead"},
        "loom": {"backend": "loom", "options": loom_options},
        "loom-cg": {"backend": "loom", "options": {**loom_options, "cudagraphs": True}},
    }[variant]


def not_run_reason(engine: str, variant: str, args: argparse.Namespace) -> str | None:
    """Why a variant is not run in this configuration, or ``None``."""
    if not args.cuda and variant in ("reduce-overhead", "loom-cg"):
        return "not run: GPU only (CUDA graphs)"
    if not args.cuda and variant == "inductor":
        return "not run on CPU: an Inductor CPU compile takes minutes on a small machine"
    if engine == "fsdp2" and variant == "capture_step" and not args.fsdp2_capture_step:
        return (
            "not run: capture_step under FSDP2 awaits its first GPU check "
            "(dist_check.py --config fsdp2-step); --fsdp2-capture-step runs it"
        )
    return None


def build(engine: str, variant: str, args: argparse.Namespace, device: torch.device) -> Built:
    import torchloom

    model = build_llama(args.size).to(device)
    side = torch.cuda.Stream() if args.cuda and variant == "capture_step" else None
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if args.cuda else None
        # the recipe for capturing DDP: built on a side stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            wrapped: nn.Module = DDP(model, device_ids=ids)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.lm.model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, capturable=args.cuda, foreach=True)
    kwargs = _compile_kwargs(variant, args.cuda)
    forward = torch.compile(wrapped, **kwargs) if kwargs is not None else wrapped

    def train_step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = forward(ids)
        loss.backward()
        opt.step()
        return loss.detach()

    step = torchloom.capture_step(train_step) if variant == "capture_step" else train_step
    return Built(step, [model, wrapped, opt, forward])


def _sync(args: argparse.Namespace) -> None:
    if args.cuda:
        torch.cuda.synchronize()


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _first_error(errors: list[str | None]) -> str | None:
    for rank, err in enumerate(errors):
        if err:
            return f"rank {rank}: {err}"
    return None


def prepare(
    engine: str, variant: str, args: argparse.Namespace, device: torch.device, ids: torch.Tensor
) -> tuple[Built | None, dict[str, Any]]:
    """Build one variant, run its first calls, measure its peak; a row of what is known."""
    row: dict[str, Any] = {}
    _sync(args)
    before = allocated_baseline(device) or 0
    if args.cuda:
        torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved() if args.cuda else 0
    built, error = None, None
    try:
        built = build(engine, variant, args, device)
        t0 = time.perf_counter()
        row["first_loss"] = float(built.step(ids))
        _sync(args)
        row["first_call_s"] = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            built.step(ids)
        _sync(args)
        if args.cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.mem_steps):
            built.step(ids)
        _sync(args)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if args.cuda else None
        reserved = (
            (torch.cuda.max_memory_reserved() - reserved_before) / 2**20 if args.cuda else None
        )
        if variant == "capture_step":
            stats = built.step.stats()  # type: ignore[attr-defined]
            row["note"] = f"capture_step {stats.state.value}, {stats.replays} replays"
            if stats.refusal is not None:
                row["note"] += f"; {str(stats.refusal).splitlines()[0][:160]}"
    except Exception as exc:  # a failing variant is a row, not a lost run
        error, peak, reserved = _short(exc), None, None
    err = _first_error(_gather(error))
    if err is not None:
        return None, {"error": err}
    peaks, reserved_peaks = _gather(peak), _gather(reserved)
    if args.cuda:
        row["peak_mib"] = max(peaks)
        row["peak_mib_ranks"] = "/".join(f"{p:.0f}" for p in peaks)
        row["peak_reserved_mib"] = max(reserved_peaks)
        if min(peaks) < 0:  # memory allocated before the build was freed meanwhile
            negative = "peak below the baseline: not a measurement"
            row["note"] = f"{row['note']}; {negative}" if row.get("note") else negative
    row["first_call_s"] = max(_gather(row["first_call_s"]))
    return built, row


def time_rounds(
    live: dict[str, Built], args: argparse.Namespace, ids: torch.Tensor
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each live variant's step time per round (seconds, the slowest rank's), in
    interleaved rounds with a rotating order; variants that failed, with the error."""
    times: dict[str, list[float]] = {name: [] for name in live}
    failed: dict[str, str] = {}
    gc.collect()
    gc.freeze()  # the compiles' heap is not walked again while timing
    try:
        for rnd in range(args.rounds):
            names = [n for n in live if n not in failed]
            k = rnd % max(len(names), 1)
            for name in names[k:] + names[:k]:
                error, took = None, None
                try:
                    _sync(args)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        live[name].step(ids)
                    _sync(args)
                    took = (time.perf_counter() - t0) / args.steps
                except Exception as exc:
                    error = _short(exc)
                err = _first_error(_gather(error))
                if err is not None:
                    failed[name] = err
                    continue
                times[name].append(max(_gather(took)))
    finally:
        gc.unfreeze()
    return times, failed


def run_engine(
    engine: str, args: argparse.Namespace, device: torch.device, ids: torch.Tensor
) -> list[dict[str, Any]]:
    rank0 = dist.get_rank() == 0
    rows: dict[str, dict[str, Any]] = {}
    live: dict[str, Built] = {}
    for variant in args.variants:
        reason = not_run_reason(engine, variant, args)
        if reason is not None:
            rows[variant] = {"note": reason}
            continue
        built, row = prepare(engine, variant, args, device, ids)
        rows[variant] = row
        if built is not None:
            live[variant] = built
        if rank0:
            state = row.get("error") or f"first call {row['first_call_s']:.1f} s"
            print(f"  [{engine}] {variant:<16} {state}", flush=True)
    times, failed = time_rounds(live, args, ids)
    for name, err in failed.items():
        rows[name]["error"] = f"while timed: {err}"
    tokens = args.size.batch * args.size.seq
    eager_loss = rows.get("eager", {}).get("first_loss")
    out = []
    for variant in args.variants:
        row = rows[variant]
        t = times.get(variant) if variant not in failed else None
        ref = REFERENCE.get(variant)
        result: dict[str, Any] = {
            "engine": engine,
            "variant": variant,
            "world": dist.get_world_size(),
            "step_ms": statistics.median(t) * 1e3 if t else None,
            "min_ms": min(t) * 1e3 if t else None,
            "max_ms": max(t) * 1e3 if t else None,
            "tokens_s_per_gpu": tokens / statistics.median(t) if t else None,
            "vs_eager": _round_ratio(times, failed, variant, "eager"),
            "reference": ref if ref != "eager" else None,
            "vs_reference": _round_ratio(times, failed, variant, ref) if ref != "eager" else None,
            "peak_mib": row.get("peak_mib"),
            "peak_mib_ranks": row.get("peak_mib_ranks"),
            "peak_reserved_mib": row.get("peak_reserved_mib"),
            "first_call_s": row.get("first_call_s"),
            "first_loss_diff": (
                abs(row["first_loss"] - eager_loss)
                if eager_loss is not None and "first_loss" in row
                else None
            ),
            "note": row.get("error") or row.get("note"),
        }
        out.append(result)
    del live
    return out


def _round_ratio(
    times: dict[str, list[float]], failed: dict[str, str], name: str, ref: str | None
) -> float | None:
    """The median over rounds of ``name``'s step time over ``ref``'s in the same round."""
    if ref is None or name in failed or ref in failed:
        return None
    a, b = times.get(name) or [], times.get(ref) or []
    per_round = [r for r in (ratio(x, y) for x, y in zip(a, b, strict=False)) if r is not None]
    return statistics.median(per_round) if per_round else None


# --- the command ----------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--engine", choices=ENGINES, nargs="+", default=list(ENGINES))
    p.add_argument("--variants", choices=VARIANTS, nargs="+", default=list(VARIANTS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (>= 14 for DDP)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--pg-timeout", type=int, default=300, help="seconds")
    p.add_argument("--fsdp2-capture-step", action="store_true")
    p.add_argument("--json", default=None, help="rank 0 writes its rows here (for --combine)")
    p.add_argument("--no-append", action="store_true", help="print only")
    p.add_argument("--combine", nargs="+", default=None, help="--json files of several sizes")
    args = p.parse_args(argv)
    args.cuda = args.device == "cuda"
    base = GPU_SIZE if args.cuda else CPU_SIZE
    args.size = dataclasses.replace(
        base,
        layers=args.layers or base.layers,
        hidden=args.hidden or base.hidden,
        batch=args.batch or base.batch,
        seq=args.seq or base.seq,
    )
    args.warmup = args.warmup or (14 if args.cuda else 2)
    args.steps = args.steps or (20 if args.cuda else 2)
    args.rounds = args.rounds or (5 if args.cuda else 2)
    if args.cuda:
        args.warmup = max(args.warmup, 14)  # capture_step under DDP: 11 warm-ups, a capture
    return args


def combine(paths: list[str], no_append: bool) -> int:
    """Tokens/s per GPU at each world size and the scaling efficiency against the
    smallest world size given."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(json.loads(Path(path).read_text())["rows"])
    worlds = sorted({r["world"] for r in rows})
    base_world = worlds[0]
    out = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["engine"] == engine):
            by_world = {
                r["world"]: r for r in rows if r["engine"] == engine and r["variant"] == variant
            }
            base = (by_world.get(base_world) or {}).get("tokens_s_per_gpu")
            row: dict[str, Any] = {"engine": engine, "variant": variant}
            for w in worlds:
                tps = (by_world.get(w) or {}).get("tokens_s_per_gpu")
                row[f"tok_s_gpu@{w}"] = tps
                if w != base_world:
                    row[f"eff@{w}"] = ratio(tps, base)
            for w in worlds:
                row[f"peak_mib@{w}"] = (by_world.get(w) or {}).get("peak_mib")
            out.append(row)
    table = format_table(out)
    print(table)
    if not no_append:
        notes = (
            f"Scaling efficiency = tokens/s per GPU at N / at {base_world} GPU(s) "
            f"(weak scaling: the same batch per GPU), from {', '.join(map(os.path.basename, paths))}."
        )
        append_results("dist", "bench_dist scaling (combined)", out, notes, device="cuda")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.combine:
        return combine(args.combine, args.no_append)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl" if args.cuda else "gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    # loom's cache: a fresh directory per rank, so first_call_s is a loom cold compile
    os.environ["TORCHLOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"bench-dist-r{rank}-")
    # NOTE: every variant compiles the same code objects (the root's and the decoder
    # layer's forward) with its own backend: more entries than Dynamo's default limit.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, args.size.vocab, (args.size.batch, args.size.seq), generator=gen)
    ids = ids.to(device)
    s = args.size
    if rank == 0:
        print(
            f"bench_dist: {world} ranks, {device.type} ({dist.get_backend()}), torch "
            f"{torch.__version__}; Llama {s.layers} layers, hidden {s.hidden}, batch {s.batch} "
            f"x seq {s.seq} per GPU; {args.rounds} rounds of {args.steps} steps",
            flush=True,
        )
    rows: list[dict[str, Any]] = []
    for engine in args.engine:
        rows += run_engine(engine, args, device, ids)
        torch._dynamo.reset()
        if rank == 0:
            print(format_table([r for r in rows if r["engine"] == engine]), flush=True)
    if rank == 0:
        notes = (
            f"`torchrun --nproc-per-node {world} benchmarks/bench_dist.py "
            f"{' '.join(sys.argv[1:])}`: LlamaForCausalLM from a config ({s.layers} layers, "
            f"hidden {s.hidden}, vocab {s.vocab}), batch {s.batch} x seq {s.seq} per GPU, AdamW; "
            f"step_ms: median of {args.rounds} interleaved rounds of {args.steps} steps "
            "(the slowest rank); peak_mib: max_memory_allocated above what was allocated "
            "before the variant was built (cuBLAS workspaces dropped first), the largest rank; "
            "peak_reserved_mib: the same with max_memory_reserved (CUDA-graph pools whole)."
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"notes": notes, "rows": rows}, indent=2))
        if not args.no_append:
            title = f"bench_dist, {world} rank(s), {device.type}"
            append_results("dist", title, rows, notes, device=device)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # NOTE: as scripts/dist_check.py: leave without the interpreter's teardown, where a
    # C++ thread of a gloo FSDP2 run can abort the process after every result is out.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
