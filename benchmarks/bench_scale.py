"""loom at a size people train: a ~1B Hugging Face Llama under FSDP2, per variant and regime.

Launch with ``torchrun``, once per node size (every rank runs the same variants in
the same order; rank 0 prints and appends to ``results/scale.md``)::

    torchrun --nproc-per-node 1 benchmarks/bench_scale.py --json scale_w1.json
    torchrun --nproc-per-node 2 benchmarks/bench_scale.py --json scale_w2.json
    torchrun --nproc-per-node 4 benchmarks/bench_scale.py --json scale_w4.json
    python benchmarks/bench_scale.py --combine scale_w1.json scale_w2.json scale_w4.json
    # a subset: --variants inductor loom --regimes compute
    # the CPU smoke (tiny config, gloo, eager codegen; CI runs it):
    torchrun --nproc-per-node 2 benchmarks/bench_scale.py --smoke

Without torchrun's environment the script runs as one rank (``python
benchmarks/bench_scale.py``, as ``scripts/gpu_tier.sh`` calls every bench).

The model: ``transformers.LlamaForCausalLM`` from a config (random weights, nothing
downloaded): 16 layers, hidden 2048, 32 heads / 8 KV heads (GQA), intermediate 5632,
vocab 32000, SDPA attention, untied embeddings (0.85B parameters), inside a root that
returns the causal-LM loss (``workloads.CausalLMLoss``). FSDP2 as torchtitan applies it:
``fully_shard`` per decoder layer, then the root; bf16 compute with fp32 master
weights and fp32 gradient reduction (``MixedPrecisionPolicy``, ``--precision bf16``;
``fp32``: none). One step is ``zero_grad``, forward, backward and an
``AdamW(capturable=True, foreach=True)`` step at sequence length 2048.

Variants (``--variants``) compile each decoder layer, as torchtitan does, and leave
the root (embedding, final norm, LM head, loss) eager:

- ``eager``;
- ``inductor``: ``torch.compile(..., backend="inductor")``;
- ``loom``: ``backend="loom"``;
- ``loom-cg``: ``backend="loom", options={"cudagraphs": True}``;
- ``capture_step``: ``torchloom.capture_step`` over the whole step, the decoder
  layers compiled by ``loom`` (the same compiled layers as the ``loom`` variant);
- ``full-inductor`` and ``full-loom``: the first design note's setting (traceable
  FSDP2): the whole model compiled with that backend, FSDP2's hooks traced into the
  graph (``skip_fsdp_hooks=False``: its all-gathers and reduce-scatters become graph
  collectives, its storage resizes and ``fsdp.copy_`` graph ops), the backward
  compiled by compiled autograd with the same backend (``fullgraph=True``); the
  optimizer step stays eager. GPU only.

The compiled region is the decoder layer's ``forward``: FSDP2's hooks (its
all-gathers and reduce-scatters) run around it, outside the graph, as with
torchtitan's ``torch.compile(block)`` before ``fully_shard(block)``. With ``--ac``
each layer's forward runs under ``torch.utils.checkpoint`` (non-reentrant) inside
the compiled region (torchtitan's order: checkpoint, then compile).

All variants share one model and one optimizer: a 1B model's weights and AdamW state
once per variant would not fit one GPU beside the activations, and sharing them lets
the variants be timed in interleaved rounds. Each decoder layer's ``forward`` is a
switch to the active variant's compiled function (one per variant, shared by the 16
layers: one Dynamo graph per variant and regime). The optimizer state is made by one
eager step before any variant runs.

Regimes (``--regimes``): ``compute`` (compute-bound: 4 x 2048 tokens per GPU) and
``strong`` (strong-scaling end: 1 x 512 per GPU). Per regime, Dynamo is reset, then
each variant runs ``--warmup`` calls (its compile, capture_step's 3 warm-ups and
capture: ``compile_s`` is their wall time less as many steady steps) and
``--mem-steps`` calls whose peak is read, then all variants are timed in
``--rounds`` interleaved rounds (order rotating) of ``--steps`` steps; a round's time
is the slowest rank's, after a barrier, device synchronized.

Columns: ``step_ms`` (median over rounds; ``min_ms``, ``q1_ms``, ``q3_ms``, ``max_ms``
the spread over rounds),
``tok_s`` (tokens per second over all GPUs) and ``tok_s_gpu``, ``mfu`` (model FLOPs
per token = 6 x non-embedding parameters + 12 x layers x hidden x seq for attention,
torchtitan's count; over ``--peak-tflops``, 989 for H100 and H200 bf16 dense),
``vs_inductor`` (median of per-round step-time ratios; below 1 is faster;
``vs_inductor_min`` / ``vs_inductor_max`` their spread),
``peak_gib`` (``max_memory_allocated`` over the ``--mem-steps`` calls: weights,
optimizer state, gradients, activations; a CUDA graph's intermediates live in its
pool, which ``allocated`` does not count after the capture), ``reserved_gib`` (what
the variant would reserve alone: the reservation of the shared weights and optimizer
state plus what its own calls added to ``memory_reserved``, compile, CUDA-graph
pools and activations included), the largest rank's; ``loom_graphs`` / ``fallbacks``
(loom's compiled graphs and eager fallbacks in the regime).

``--combine`` (no torchrun) reads the ``--json`` files of several node sizes and
prints tokens/s per GPU per size and the scaling efficiency against the smallest size.

Defaults on GPU: 4 warm-up calls, then 10 rounds of 10 steps in every regime (3
rounds of 4 let one slow round move a median by 60%).

On CPU (``--smoke``: gloo, a 2-layer hidden-32 Llama, 2 rounds of 1 step) loom runs
with ``codegen="eager"``; ``inductor``, ``loom-cg`` and the full-graph variants are
not run and capture_step runs uncaptured. It checks the harness, not speed; rank 0 prints one
``SCALE_RESULT {json}`` line per row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import workloads
from _harness import append_results, format_table, ratio
from workloads import CausalLMLoss, HFSize

VARIANTS = ("eager", "inductor", "loom", "loom-cg", "capture_step", "full-inductor", "full-loom")
#: The full-graph variants and the backend each compiles the whole model with.
FULL_GRAPH = {"full-inductor": "inductor", "full-loom": "loom"}
#: Logging calls a full-graph trace drops (FSDP2's hooks log at debug level).
QUIET_LOGGING = {logging.Logger.debug}
#: GPU defaults: timed rounds and steps per round, in every regime.
ROUNDS, STEPS = 10, 10
#: Per-GPU batch (sequences, tokens each) of each regime.
REGIMES = {"compute": (4, 2048), "strong": (1, 512)}
SMOKE_REGIMES = {"compute": (2, 16), "strong": (1, 8)}
#: ~1B Llama (TinyLlama's widths, 16 layers); ``batch``/``seq`` come from the regime.
GPU_SIZE = HFSize(16, 2048, 32, 8, 5632, 32000, batch=4, seq=2048, window=1)
SMOKE_SIZE = HFSize(2, 32, 4, 2, 64, 128, batch=2, seq=16, window=1)
#: H100 / H200 SXM bf16 dense peak, TFLOP/s.
PEAK_TFLOPS = 989.0


# --- the model, its layers' forward per variant ------------------------------------------------


def build_model(size: HFSize, device: torch.device, precision: str) -> CausalLMLoss:
    """The Llama, each decoder layer and then the root sharded with ``fully_shard``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = CausalLMLoss(workloads.build_llama(size)).to(device)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.lm.model.layers)  # type: ignore[union-attr,arg-type]


class LayerSwitch:
    """Each decoder layer's ``forward``: the active variant's function, called with the
    layer as its first argument. A variant's function is compiled once and serves every
    layer (Dynamo lifts the layer's parameters as graph inputs: one graph per variant)."""

    def __init__(self, layers: list[nn.Module], checkpoint: bool) -> None:
        forward = type(layers[0]).forward

        def plain(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return forward(layer, *args, **kwargs)

        def checkpointed(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)

        self.base: Callable[..., Any] = checkpointed if checkpoint else plain
        self.fns: dict[str, Callable[..., Any]] = {"eager": self.base}
        self.active = "eager"
        for layer in layers:
            # NOTE: an instance attribute: FSDP2's hooks stay in ``Module.__call__``,
            # around the compiled region.
            layer.forward = functools.partial(self._call, layer)

    def _call(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.fns[self.active](layer, *args, **kwargs)

    def compile(self, name: str, **kwargs: Any) -> None:
        self.fns[name] = torch.compile(self.base, **kwargs)


def compile_kwargs(variant: str, cuda: bool) -> dict[str, Any] | None:
    """How ``variant`` compiles the layers (``None``: it does not compile)."""
    loom_options: dict[str, Any] = {} if cuda else {"codegen": "eager"}
    return {
        "eager": None,
        "inductor": {"backend": "inductor"},
        "loom": {"backend": "loom", "options": loom_options},
        "loom-cg": {"backend": "loom", "options": {**loom_options, "cudagraphs": True}},
        "capture_step": None,  # the ``loom`` variant's layers
        "full-inductor": None,  # the whole model: see ``full_graph_step``
        "full-loom": None,
    }[variant]


def layers_of(variant: str) -> str:
    """Whose compiled layers a variant runs (a full-graph variant traces the plain ones)."""
    if variant in FULL_GRAPH:
        return "eager"
    return "loom" if variant == "capture_step" else variant


def not_run_reason(variant: str, cuda: bool) -> str | None:
    if not cuda and variant == "loom-cg":
        return "not run: GPU only (CUDA graphs)"
    if not cuda and variant in FULL_GRAPH:
        return "not run: GPU only (traceable FSDP2 with compiled autograd, NCCL)"
    if not cuda and variant == "inductor":
        return "not run on CPU: an Inductor CPU compile takes minutes on a small machine"
    return None


@contextlib.contextmanager
def traceable_fsdp2() -> Iterator[None]:
    """Dynamo traces FSDP2's hooks (read when a hook is called) and drops their debug
    log calls, which a ``fullgraph`` backward cannot break on."""
    # NOTE: torch 2.11 logs an error per compile while ignore_logging_functions holds a
    # function (its compile-metrics record JSON-encodes the config): silenced here.
    metrics = logging.getLogger("torch._dynamo.metrics_context")
    level = metrics.level
    metrics.setLevel(logging.CRITICAL)
    try:
        with torch._dynamo.config.patch(
            skip_fsdp_hooks=False, ignore_logging_functions=QUIET_LOGGING
        ):
            yield
    finally:
        metrics.setLevel(level)


def full_graph_step(bench: Bench, variant: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step with the whole model compiled by ``variant``'s backend, FSDP2's hooks
    traced (``skip_fsdp_hooks=False``, read when a hook is called: at trace time) and
    the backward compiled by compiled autograd (``fullgraph=True``: FSDP2's debug log
    calls are no-ops, as under export); the optimizer step eager. The decoder layers
    run their plain forward (``layers_of``)."""
    from torch._dynamo import compiled_autograd

    kwargs = compile_kwargs(FULL_GRAPH[variant], bench.cuda) or {}
    model = torch.compile(bench.model, **kwargs)
    backward = torch.compile(fullgraph=True, **kwargs)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with traceable_fsdp2(), compiled_autograd._enable(backward):
            bench.opt.zero_grad(set_to_none=True)
            loss = model(ids)
            loss.backward()
            bench.opt.step()
        return loss.detach()

    return step


def flops_per_token(model: nn.Module, size: HFSize, seq: int) -> float:
    """torchtitan's count: 6 x non-embedding parameters + 12 x layers x hidden x seq."""
    params = sum(p.numel() for p in model.parameters())  # DTensor: the global numel
    embedding = size.vocab * size.hidden
    return 6.0 * (params - embedding) + 12.0 * size.layers * size.hidden * seq


# --- measuring ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    args: argparse.Namespace
    device: torch.device
    model: nn.Module
    opt: torch.optim.Optimizer
    switch: LayerSwitch
    state_reserved: int  # bytes reserved for the weights and optimizer state alone

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def train_step(self, ids: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(ids)
        loss.backward()
        self.opt.step()
        return loss.detach()


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _first_error(errors: list[str | None]) -> str | None:
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def prepare(
    bench: Bench, variant: str, ids: torch.Tensor
) -> tuple[Callable[[torch.Tensor], Any] | None, dict[str, Any]]:
    """Compile (or capture) one variant and read its memory; its step and a row."""
    args, row = bench.args, {}
    step: Callable[[torch.Tensor], Any] = bench.train_step
    error: str | None = None
    peak = reserved = compile_s = None
    try:
        kwargs = compile_kwargs(variant, bench.cuda)
        if kwargs is not None:
            bench.switch.compile(variant, **kwargs)
        bench.switch.active = layers_of(variant)
        if variant == "capture_step":
            import torchloom

            step = torchloom.capture_step(bench.train_step)
        elif variant in FULL_GRAPH:
            step = full_graph_step(bench, variant)
        bench.sync()
        gc.collect()
        if bench.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        reserved0 = torch.cuda.memory_reserved() if bench.cuda else 0
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step(ids)
        bench.sync()
        warm_s = time.perf_counter() - t0
        reserved_peak = torch.cuda.max_memory_reserved() if bench.cuda else 0
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.mem_steps):
            step(ids)
        bench.sync()
        steady = (time.perf_counter() - t0) / max(args.mem_steps, 1)
        compile_s = max(warm_s - args.warmup * steady, 0.0)
        if bench.cuda:
            peak = torch.cuda.max_memory_allocated() / 2**30
            reserved_peak = max(reserved_peak, torch.cuda.max_memory_reserved())
            reserved = (bench.state_reserved + reserved_peak - reserved0) / 2**30
        if variant == "capture_step":
            stats = step.stats()  # type: ignore[attr-defined]
            row["note"] = f"capture_step {stats.state.value}, {stats.replays} replays"
            if stats.refusal is not None:
                row["note"] += f"; {str(stats.refusal).splitlines()[0][:160]}"
    except Exception as exc:  # a failing variant is a row, not a lost run
        error = _short(exc)
    err = _first_error(_gather(error))
    if err is not None:
        return None, {"error": err}
    row["compile_s"] = max(_gather(compile_s))
    if bench.cuda:
        row["peak_gib"] = max(_gather(peak))
        row["reserved_gib"] = max(_gather(reserved))
    return step, row


def time_rounds(
    bench: Bench, live: dict[str, Callable[[torch.Tensor], Any]], ids: torch.Tensor
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each live variant's step seconds per round (the slowest rank's), in interleaved
    rounds with a rotating order; the variants that failed, with the error."""
    args = bench.args
    times: dict[str, list[float]] = {name: [] for name in live}
    failed: dict[str, str] = {}
    gc.collect()
    gc.freeze()  # the compiles' heap is not walked again while timing
    try:
        for rnd in range(args.rounds):
            names = [n for n in live if n not in failed]
            k = rnd % max(len(names), 1)
            for name in names[k:] + names[:k]:
                bench.switch.active = layers_of(name)
                error, took = None, None
                try:
                    live[name](ids)  # the switch's first call: off the clock
                    bench.sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        live[name](ids)
                    bench.sync()
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


def loom_counts() -> tuple[int, int]:
    """loom's Dynamo graphs and eager fallbacks since the last reset (capture_step's
    records left out)."""
    import torchloom

    graphs = [g for g in torchloom.report() if not g.name.startswith("capture_step")]
    return len(graphs), sum(1 for g in graphs if g.fallback)


def run_regime(bench: Bench, regime: str) -> list[dict[str, Any]]:
    args, rank0 = bench.args, dist.get_rank() == 0
    batch, seq = args.regime_shapes[regime]
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    ids = torch.randint(0, args.size.vocab, (batch, seq), generator=gen).to(bench.device)
    torch._dynamo.reset()
    import torchloom

    torchloom.reset()
    bench.switch.fns = {"eager": bench.switch.base}
    rows: dict[str, dict[str, Any]] = {}
    live: dict[str, Callable[[torch.Tensor], Any]] = {}
    for variant in args.variants:
        reason = not_run_reason(variant, bench.cuda)
        if reason is not None:
            rows[variant] = {"note": reason}
            continue
        step, row = prepare(bench, variant, ids)
        rows[variant] = row
        if step is not None:
            live[variant] = step
        if rank0:
            state = row.get("error") or f"compile {row['compile_s']:.1f} s"
            print(f"  [{regime}] {variant:<13} {state}", flush=True)
    times, failed = time_rounds(bench, live, ids)
    graphs, fallbacks = loom_counts()
    tokens = batch * seq
    fpt = flops_per_token(bench.model, args.size, seq)
    out = []
    for variant in args.variants:
        row, t = rows[variant], times.get(variant) if variant not in failed else None
        if variant in failed:
            row["error"] = f"while timed: {failed[variant]}"
        step_s = statistics.median(t) if t else None
        q1, q3 = _quartiles(t)
        lo, mid, hi = _round_ratios(times, failed, variant, "inductor")
        tok_s_gpu = tokens / step_s if step_s else None
        mfu = tok_s_gpu * fpt / (args.peak_tflops * 1e12) if tok_s_gpu and bench.cuda else None
        out.append(
            {
                "regime": regime,
                "variant": variant,
                "world": world,
                "batch": f"{batch}x{seq}",
                "step_ms": step_s * 1e3 if step_s else None,
                "min_ms": min(t) * 1e3 if t else None,
                "q1_ms": q1 * 1e3 if q1 is not None else None,
                "q3_ms": q3 * 1e3 if q3 is not None else None,
                "max_ms": max(t) * 1e3 if t else None,
                "rounds": len(t) if t else 0,
                "tok_s": tok_s_gpu * world if tok_s_gpu else None,
                "tok_s_gpu": tok_s_gpu,
                "mfu": mfu,
                "vs_inductor": mid,
                "vs_inductor_min": lo,
                "vs_inductor_max": hi,
                "peak_gib": row.get("peak_gib"),
                "reserved_gib": row.get("reserved_gib"),
                "compile_s": row.get("compile_s"),
                "ac": args.ac,
                "loom_graphs": graphs if variant in LOOM_VARIANTS else None,
                "fallbacks": fallbacks if variant in LOOM_VARIANTS else None,
                "note": row.get("error") or row.get("note"),
            }
        )
    del live
    return out


#: The variants whose rows carry loom's graph and fallback counts.
LOOM_VARIANTS = ("loom", "loom-cg", "capture_step", "full-loom")


def _quartiles(values: list[float] | None) -> tuple[float | None, float | None]:
    """The first and third quartiles (``None`` with fewer than two values)."""
    if not values or len(values) < 2:
        return None, None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _round_ratios(
    times: dict[str, list[float]], failed: dict[str, str], name: str, ref: str
) -> tuple[float | None, float | None, float | None]:
    """The min, median and max over rounds of ``name``'s step time over ``ref``'s in
    the same round."""
    if name == ref or name in failed or ref in failed:
        return None, None, None
    pairs = zip(times.get(name) or [], times.get(ref) or [], strict=False)
    per_round = [r for r in (ratio(a, b) for a, b in pairs) if r is not None]
    if not per_round:
        return None, None, None
    return min(per_round), statistics.median(per_round), max(per_round)


# --- the command -------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny config, prints only")
    p.add_argument("--variants", choices=VARIANTS, nargs="+", default=list(VARIANTS))
    p.add_argument("--regimes", choices=tuple(REGIMES), nargs="+", default=list(REGIMES))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ac", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (>= 4: capture_step)")
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument("--pg-timeout", type=int, default=600, help="seconds")
    p.add_argument("--json", default=None, help="rank 0 writes its rows here (for --combine)")
    p.add_argument("--no-append", action="store_true", help="print only")
    p.add_argument("--combine", nargs="+", default=None, help="--json files of several sizes")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.no_append = args.device or "cpu", True
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    base = GPU_SIZE if not args.smoke else SMOKE_SIZE
    args.size = dataclasses.replace(base, layers=args.layers or base.layers)
    args.regime_shapes = SMOKE_REGIMES if args.smoke else REGIMES
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.warmup = args.warmup or (4 if cuda else 2)
    args.steps = args.steps or (STEPS if cuda else 1)
    args.rounds = args.rounds or (ROUNDS if cuda else 2)
    return args


def combine(paths: list[str], no_append: bool) -> int:
    """Tokens/s per GPU at each node size and the scaling efficiency against the
    smallest size given (the same batch per GPU: weak scaling)."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(json.loads(Path(path).read_text())["rows"])
    worlds = sorted({r["world"] for r in rows})
    out = []
    for regime, variant in dict.fromkeys((r["regime"], r["variant"]) for r in rows):
        by_world = {r["world"]: r for r in rows if (r["regime"], r["variant"]) == (regime, variant)}
        base = (by_world.get(worlds[0]) or {}).get("tok_s_gpu")
        row: dict[str, Any] = {"regime": regime, "variant": variant}
        for w in worlds:
            tps = (by_world.get(w) or {}).get("tok_s_gpu")
            row[f"tok_s_gpu@{w}"] = tps
            if w != worlds[0]:
                row[f"eff@{w}"] = ratio(tps, base)
        for w in worlds:
            row[f"peak_gib@{w}"] = (by_world.get(w) or {}).get("peak_gib")
        for w in worlds:
            row[f"reserved_gib@{w}"] = (by_world.get(w) or {}).get("reserved_gib")
        out.append(row)
    print(format_table(out))
    if not no_append:
        notes = (
            f"Scaling efficiency = tokens/s per GPU at N / at {worlds[0]} GPU(s), from "
            f"{', '.join(map(os.path.basename, paths))}."
        )
        append_results("scale", "bench_scale scaling (combined)", out, notes, device="cuda")
    return 0


def _init_process_group(args: argparse.Namespace) -> None:
    """torchrun's process group, or one rank of its own when run without torchrun."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.combine:
        return combine(args.combine, args.no_append)
    _init_process_group(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # loom's cache: a fresh directory per rank, so compile_s is a loom cold compile
    os.environ["TORCHLOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"bench-scale-r{rank}-")
    # NOTE: every variant compiles the same code object (the layer's forward) with its
    # own backend: more entries than Dynamo's default limit.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = build_model(args.size, device, args.precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=cuda, foreach=True)
    switch = LayerSwitch(decoder_layers(model), args.ac)
    bench = Bench(args, device, model, opt, switch, 0)
    # One eager step makes the optimizer state (and FSDP2's lazy init) before any variant.
    batch, seq = args.regime_shapes[args.regimes[-1]]
    bench.train_step(torch.zeros(batch, seq, dtype=torch.long, device=device))
    opt.zero_grad(set_to_none=True)
    bench.sync()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        bench.state_reserved = torch.cuda.memory_reserved()
    params = sum(p.numel() for p in model.parameters())
    s = args.size
    if rank == 0:
        print(
            f"bench_scale: {world} ranks, {device.type} ({dist.get_backend()}), torch "
            f"{torch.__version__}; Llama {s.layers} layers, hidden {s.hidden}, heads "
            f"{s.heads}/{s.kv_heads}, intermediate {s.intermediate}, vocab {s.vocab}: "
            f"{params / 1e9:.3f}B parameters, {args.precision}, AC {'on' if args.ac else 'off'}; "
            f"{args.rounds} rounds of {args.steps} steps",
            flush=True,
        )
    rows: list[dict[str, Any]] = []
    for regime in args.regimes:
        rows += run_regime(bench, regime)
        if rank == 0:
            print(format_table([r for r in rows if r["regime"] == regime]), flush=True)
    if rank == 0:
        for row in rows:
            print("SCALE_RESULT " + json.dumps(row), flush=True)
        notes = (
            f"`torchrun --nproc-per-node {world} benchmarks/bench_scale.py "
            f"{' '.join(sys.argv[1:])}`: LlamaForCausalLM from a config ({s.layers} layers, "
            f"hidden {s.hidden}, {s.heads}/{s.kv_heads} heads, intermediate {s.intermediate}, "
            f"vocab {s.vocab}; {params / 1e9:.3f}B parameters), FSDP2 per layer + root, "
            f"{args.precision}, AdamW; each decoder layer compiled (full-*: the whole model, "
            "FSDP2's hooks traced, compiled autograd); step_ms: median of "
            f"{args.rounds} interleaved rounds of {args.steps} steps (the slowest rank), "
            "min/q1/q3/max their spread; "
            f"MFU against {args.peak_tflops:.0f} TFLOP/s; peak_gib: max_memory_allocated "
            "over the variant's steps (largest rank); reserved_gib: the shared weights' and "
            "optimizer state's reservation plus what the variant's own calls added."
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"notes": notes, "rows": rows}, indent=2))
        if not args.no_append:
            title = f"bench_scale, {world} rank(s), {device.type}"
            append_results("scale", title, rows, notes, device=device)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # NOTE: as bench_dist.py: leave without the interpreter's teardown, where a C++
    # thread of a gloo FSDP2 run can abort the process after every result is out.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
