"""Hugging Face decoders (Llama, GPT-2, built from configs): eager / Inductor / loom, side by side.

The models are ``transformers.LlamaForCausalLM`` and ``GPT2LMHeadModel``
built from configs with random weights (nothing is downloaded): 4 layers,
hidden 512 on CUDA, tiny ones with ``--quick``. Two workloads per model:

- ``train``: a training step, forward with ``labels`` (the causal-LM
  cross-entropy), backward, gradients cleared first. The optimizer step is
  left out: it is not compiled and costs every variant the same.
- ``forward_b1``: batch-1 inference, one forward of a fixed 32-token window
  under ``torch.no_grad`` with ``use_cache=False``. NOTE: not a KV-cache decode
  step. A ``DynamicCache`` grows by one position per token (a new shape each
  step: recompiles or dynamic shapes), and a ``StaticCache`` keeps its write
  position in cache internals that changed between transformers releases
  (5.x advances a counter on each call, 4.x reads ``cache_position``), so a
  repeatable timed step would depend on them. A fixed short window keeps the
  graph static and the step launch-bound, which is what batch-1 decode is.

Variants: ``eager``, ``inductor``, ``inductor-ro`` (``mode="reduce-overhead"``,
CUDA only), ``loom`` (Inductor codegen) and ``loom-cudagraphs``
(``options={"cudagraphs": True}``, CUDA only). Each variant compiles a fresh
copy of the model with a reset Dynamo and fresh, empty compile caches
(``compile_s`` is a cold compile), is checked against eager (``max_abs_diff``
of the loss or logits), then all variants are timed in interleaved rounds;
``vs_eager``, ``vs_inductor`` and ``vs_inductor_ro`` are medians of per-round
ratios. ``graphs`` counts the graphs Dynamo compiled, ``fallbacks`` loom's
graphs run eagerly.

Memory, on CUDA: ``peak_mib`` is the peak allocated during one warm step
above what was allocated before it. That hides memory a CUDA-graph variant
holds between steps (its pools and static outputs), so ``resident_mib`` is
the memory the variant reserves after warm-up beyond its model (the caching
allocator's reserved bytes, unused cached blocks released first: a CUDA-graph
pool counts whole, as reduce-overhead's pools keep their memory reserved
while their tensors are "freed"), and ``footprint_mib`` the sum: the memory
the step needs. ``footprint_vs_ro`` compares it with reduce-overhead's.

    python benchmarks/bench_hf.py --device cuda
    python benchmarks/bench_hf.py --device cpu --quick --no-append
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
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
    reserved_memory,
    time_fn,
    time_once,
)
from workloads import HF_GPU_SIZE as GPU_SIZE
from workloads import HF_QUICK_SIZE as QUICK_SIZE
from workloads import HFSize as Size
from workloads import build_gpt2, build_llama

# NOTE: the model is built from a config: nothing may be downloaded.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

ROUNDS = 10
START = time.perf_counter()


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    kwargs: Mapping[str, Any] | None  # torch.compile keyword arguments; None: eager
    cuda_only: bool = False

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return fn if self.kwargs is None else torch.compile(fn, **self.kwargs)


VARIANTS = (
    Variant("eager", None),
    Variant("inductor", {"backend": "inductor"}),
    Variant("inductor-ro", {"backend": "inductor", "mode": "reduce-overhead"}, cuda_only=True),
    Variant("loom", {"backend": "loom"}),
    Variant(
        "loom-cudagraphs", {"backend": "loom", "options": {"cudagraphs": True}}, cuda_only=True
    ),
)


MODELS: dict[str, Callable[[Size], nn.Module]] = {"llama": build_llama, "gpt2": build_gpt2}


def train_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def forward_b1(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    name: str
    train: bool
    fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    shape: Callable[[Size], tuple[int, int]]


WORKLOADS = (
    Workload("train", True, train_step, lambda s: (s.batch, s.seq)),
    Workload("forward_b1", False, forward_b1, lambda s: (1, s.window)),
)


def _runner(
    w: Workload, model: nn.Module, fn: Callable[..., torch.Tensor], ids: torch.Tensor
) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        # NOTE: a step must not reuse the previous step's CUDA-graph outputs;
        # marking each step is a no-op for every other variant.
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        if not w.train:
            with torch.no_grad():
                return fn(model, ids)
        for p in model.parameters():
            p.grad = None
        loss = fn(model, ids)
        loss.backward()
        return loss.detach()

    return run


def _loom_fallbacks() -> int | None:
    import torchloom

    return sum(1 for g in torchloom.report() if g.fallback)


def _reset() -> None:
    from torch._dynamo.utils import counters

    import torchloom

    torch._dynamo.reset()
    counters.clear()
    torchloom.reset()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _warm_process(device: torch.device) -> None:
    """Pay the one-time costs (imports, worker pools, CUDA context) before timing compiles."""
    with fresh_inductor_cache():
        torch._dynamo.reset()
        f = torch.compile(lambda x: torch.relu(x @ x) + 1.0, backend="inductor")
        torch.autograd.backward(f(torch.randn(16, 16, device=device, requires_grad=True)).sum())
        torch._dynamo.reset()


def run_workload(
    model_name: str,
    w: Workload,
    variants: tuple[Variant, ...],
    size: Size,
    device: torch.device,
    iters: int,
) -> list[dict[str, Any]]:
    base = MODELS[model_name](size).to(device).train(w.train)
    ids = torch.randint(0, size.vocab, w.shape(size), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    ref = _runner(w, base, w.fn, ids)().clone()
    rows: list[dict[str, Any]] = []
    runners: dict[str, Callable[[], torch.Tensor]] = {}
    models = []  # keep every variant's model (and its compiled code) alive for the timing
    for v in variants:
        model = copy.deepcopy(base)
        models.append(model)
        row: dict[str, Any] = {"workload": f"{model_name}_{w.name}", "variant": v.name}
        # NOTE: after the reset, which drops the previous variant's compiled code
        # (and with it any CUDA-graph pool it held).
        _reset()
        before = _reserved(device)
        with fresh_inductor_cache():
            try:
                run = _runner(w, model, v.wrap(w.fn), ids)
                row["compile_s"] = time_once(run, device) if v.kwargs is not None else None
                row["max_abs_diff"] = float((run().clone().float() - ref.float()).abs().max())
                time_fn(run, warmup=3, iters=1, device=device)
                mem = peak_memory(run, device)
                row["peak_mib"] = None if mem is None else mem / 2**20
                held = _reserved(device)
                if mem is not None and held is not None and before is not None:
                    row["resident_mib"] = (held - before) / 2**20
                    row["footprint_mib"] = row["resident_mib"] + row["peak_mib"]
                row["graphs"] = _graphs() if v.kwargs is not None else None
                row["fallbacks"] = _loom_fallbacks() if v.name.startswith("loom") else None
                runners[v.name] = run
            except Exception as exc:  # a failing variant is a row, not a lost run
                row["error"] = repr(exc)[:200]
        rows.append(row)
        compiled = f"{row['compile_s']:.1f} s" if row.get("compile_s") is not None else "-"
        print(
            f"  {model_name}_{w.name:<11} {v.name:<16} compile {compiled:>8}  "
            f"(at {time.perf_counter() - START:.0f} s)",
            flush=True,
        )
    # NOTE: timed in interleaved rounds with a rotating order, so host noise and
    # the variant timed right after a CUDA-graph one hit every variant alike.
    # NOTE: the compiles leave a large heap; frozen, it is not walked again by the
    # collection ``time_fn`` runs before each of its calls (a second each, else).
    gc.collect()
    gc.freeze()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    medians: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners.items())
    for rnd in range(ROUNDS):
        for name, run in order[rnd % len(order) :] + order[: rnd % len(order)]:
            times = time_fn(run, warmup=2, iters=max(1, iters // ROUNDS), device=device).times_s
            samples[name] += times
            medians[name].append(statistics.median(times))
    gc.unfreeze()
    print(
        f"  {model_name}_{w.name:<11} timed {len(order)} variants (at {time.perf_counter() - START:.0f} s)"
    )
    out = []
    for row in rows:
        name = row["variant"]
        timing = Timing(tuple(samples[name])).as_dict() if name in samples else {}
        ratios = {
            f"vs_{ref_name.replace('-', '_')}": _round_ratio(medians, name, ref_name)
            for ref_name in ("eager", "inductor", "inductor-ro")
        }
        head = {"workload": row["workload"], "variant": name}
        rest = {k: v for k, v in row.items() if k not in head}
        out.append({**head, **timing, **ratios, **rest, **_footprint_vs_ro(rows, row)})
    torch._dynamo.reset()
    # NOTE: printed per workload, so a run cut short keeps what it measured.
    print(format_table(out), flush=True)
    return out


def _reserved(device: torch.device) -> int | None:
    return reserved_memory(device)


def _footprint_vs_ro(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    ro = next((r for r in rows if r["variant"] == "inductor-ro"), None)
    own, other = row.get("footprint_mib"), None if ro is None else ro.get("footprint_mib")
    if own is None or not other:
        return {}
    return {"footprint_vs_ro": own / other}


def _round_ratio(medians: dict[str, list[float]], name: str, ref: str) -> float | None:
    own, other = medians.get(name), medians.get(ref)
    if not own or not other:
        return None
    return statistics.median(a / b for a, b in zip(own, other, strict=True))


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads", default=None, help="comma-separated subset of: train, forward_b1"
    )
    parser.add_argument(
        "--models", default="llama,gpt2", help="comma-separated subset of: llama, gpt2"
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "", argv, _configure)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    size = QUICK_SIZE if args.quick else GPU_SIZE
    wanted = (
        {w.name for w in WORKLOADS} if args.workloads is None else set(args.workloads.split(","))
    )
    unknown = wanted - {w.name for w in WORKLOADS}
    if unknown:
        raise SystemExit(f"unknown workloads: {sorted(unknown)}")
    models = args.models.split(",")
    if set(models) - set(MODELS):
        raise SystemExit(f"unknown models: {sorted(set(models) - set(MODELS))}")
    variants = tuple(v for v in VARIANTS if device.type == "cuda" or not v.cuda_only)
    if args.variants is not None:
        picked = set(args.variants.split(","))
        if picked - {v.name for v in VARIANTS}:
            raise SystemExit(f"unknown variants: {sorted(picked - {v.name for v in VARIANTS})}")
        variants = tuple(v for v in variants if v.name in picked)
    print(f"Hugging Face {models} benchmark on {device} with {size}, {args.iters} iterations")
    _warm_process(device)
    rows: list[dict[str, Any]] = []
    for model_name in models:
        for w in WORKLOADS:
            if w.name in wanted:
                rows += run_workload(model_name, w, variants, size, device, args.iters)
    if not args.no_append:
        notes = (
            f"{', '.join(models)} (CausalLM models from configs), {size}. `train`: forward with labels + backward "
            "(no optimizer step); `forward_b1`: batch-1 forward of a fixed window, no KV cache "
            "(see the script's docstring). Each variant: fresh model copy, reset Dynamo, empty "
            "compile caches (`compile_s` is cold). Ratios are medians of "
            f"{ROUNDS} interleaved rounds' ratios.{' Quick run.' if args.quick else ''}"
        )
        path = append_results(
            "hf",
            f"Hugging Face {' and '.join(models)}: eager / Inductor / loom on {device}",
            rows,
            notes,
            device=device,
        )
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
