"""A Lightning fit of a Hugging Face GPT-2 (built from a config, bf16-mixed): eager, loom's
per-graph CUDA graphs (``mode="reduce-overhead"``), and the whole step captured by
``torchloom.trainers.lightning_capture_step()`` (over the eager model, and over a
loom-compiled one).

Each variant fits its own copy of one model (same initial weights, same batches) with
``AdamW(capturable=True)``. Rounds are interleaved (round r fits every variant in turn,
each for ``--steps`` steps with a fresh ``Trainer``; a first untimed fit compiles and warms
up). Per fit: steps per second over the steps after ``--skip`` (synchronized at both
ends, so a capture's warm-up and recording are not timed) and the peak CUDA memory
allocated during the fit above what was allocated before it (model, optimizer state,
activations, graph pools). Reported: medians over rounds with min-max spread, and the
largest difference of any step's loss from eager's in the first fit (bf16: not exact).

    python benchmarks/bench_trainers.py --device cuda             # 1 GPU
    python benchmarks/bench_trainers.py --device cuda --devices 2 # Lightning's DDP
    python benchmarks/bench_trainers.py --smoke                   # CPU check that it runs
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio, sync

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 50257


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 1 round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=50, help="steps per fit")
    parser.add_argument("--skip", type=int, default=20, help="untimed steps at each fit's start")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--devices", type=int, default=1, help=">1: Lightning's DDP strategy")
    parser.add_argument("--variants", default=None, help="comma-separated variant names")


def build_model(args: argparse.Namespace) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=max(1, args.hidden // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lightning_module(model: nn.Module, device_type: str) -> Any:
    import pytorch_lightning as pl

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if device_type != "cuda":  # the smoke run (capturable AdamW needs a device)
                return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)
            # NOTE: a tensor lr and capturable=True: a captured step reads both on the device.
            lr = torch.tensor(1e-4, device=self.device)
            return torch.optim.AdamW(self.parameters(), lr=lr, capturable=True, foreach=True)

    return CausalLM()


def variants(args: argparse.Namespace) -> dict[str, tuple[Callable[[nn.Module], None], bool]]:
    """name -> (how the model is prepared, whether the step is captured)."""
    loom = {"options": {"codegen": "eager"}} if args.smoke else {}
    cg = {"options": {"codegen": "eager", "cudagraphs": True}} if args.smoke else {}
    if not args.smoke:
        cg = {"mode": "reduce-overhead"}

    def plain(m: nn.Module) -> None:
        return None

    # the like-for-like reference of loom-cg: Inductor with its CUDA graphs (aot_eager
    # in the CPU smoke run, where Inductor's first compile costs tens of seconds)
    ref = {"backend": "aot_eager"} if args.smoke else {"mode": "reduce-overhead"}
    return {
        "eager": (plain, False),
        "inductor-cg": (lambda m: m.compile(**ref), False),
        "loom-cg": (lambda m: m.compile(backend="loom", **cg), False),
        "capture-step": (plain, True),
        "capture-step+loom": (lambda m: m.compile(backend="loom", **loom), True),
    }


def clock(skip: int, device: torch.device) -> Any:
    """A Lightning callback: every step's loss, and the time after ``skip`` steps."""
    import pytorch_lightning as pl

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []
            self.t0 = self.t1 = 0.0
            self.timed = 0

        def on_train_batch_start(self, trainer: Any, m: Any, batch: Any, idx: int) -> None:
            if len(self.losses) == skip:
                sync(device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, m: Any, out: Any, *_: Any) -> None:
            self.losses.append(out["loss"].detach().clone())

        def on_train_end(self, trainer: Any, m: Any) -> None:
            sync(device)
            self.t1 = time.perf_counter()
            self.timed = len(self.losses) - skip

    return Clock()


def fit(
    module: Any, batches: list[torch.Tensor], args: argparse.Namespace, captured: bool, steps: int
) -> dict[str, Any]:
    import pytorch_lightning as pl

    import loom_cudagraph
    import torchloom.trainers

    device = torch.device(args.device)
    timer = clock(min(args.skip, steps - 1), device)
    callbacks: list[Any] = [timer]
    step_cb = None
    if captured:
        capturer = loom_cudagraph.HostCapturer() if args.smoke else None
        step_cb = torchloom.trainers.lightning_capture_step(capturer=capturer)
        callbacks.append(step_cb)
    extra = {"strategy": "ddp", "devices": args.devices} if args.devices > 1 else {"devices": 1}
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **extra,
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    gc.collect()
    before = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, loader)
    out: dict[str, Any] = {
        "losses": [float(loss) for loss in timer.losses],
        "steps_per_s": timer.timed / (timer.t1 - timer.t0) if timer.t1 > timer.t0 else None,
        "steps_run": len(timer.losses),
        "global_step": trainer.global_step,
    }
    if device.type == "cuda":
        out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if step_cb is not None:
        stats = step_cb.stats()
        out["capture"] = (
            f"{stats.state.value}, {stats.recordings} rec, {stats.replays} replays"
            + (f", refused: {stats.refusal}" if stats.refusal else "")
        )[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "", argv, _configure)
    if args.smoke:
        args.device, args.no_append, args.rounds, args.steps, args.skip = "cpu", True, 2, 6, 4
        args.layers, args.hidden, args.batch, args.seq = 1, 32, 2, 16
    args.vocab = 128 if args.smoke else VOCAB
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as a bf16 fit runs
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(8)]
    batches = [batches[i % len(batches)] for i in range(args.steps)]
    chosen = variants(args)
    if args.variants:
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    base = build_model(args)
    modules = {}
    for name, (prepare, _) in chosen.items():
        model = copy.deepcopy(base)
        prepare(model)
        modules[name] = lightning_module(model, device.type)
    print(
        f"Lightning fit of GPT-2 ({args.layers} layers, {args.hidden} wide, batch {args.batch}x"
        f"{args.seq}) on {device} x{args.devices}: {args.rounds} rounds of {args.steps} steps",
        flush=True,
    )
    first: dict[str, dict[str, Any]] = {}
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for rnd in range(args.rounds + 1):  # round 0: compile, warm up, losses
        for name, (_, captured) in chosen.items():
            try:
                got = fit(modules[name], batches, args, captured, args.steps)
            except Exception as exc:  # a failing variant is a row, not a lost run
                got = {"error": repr(exc)[:300]}
            if rnd == 0:
                first[name] = got
            else:
                per[name].append(got)
            print(f"  round {rnd} {name:<18} {got.get('steps_per_s', got.get('error'))}")
    rows = []
    eager_losses = first.get("eager", {}).get("losses")
    for name in chosen:
        runs = [r for r in per[name] if r.get("steps_per_s")]
        row: dict[str, Any] = {"variant": name}
        if runs:
            rates = [r["steps_per_s"] for r in runs]
            row.update(
                steps_per_s=statistics.median(rates),
                spread=f"{min(rates):.2f}-{max(rates):.2f}",
            )
            if "peak_mib" in runs[0]:
                row["peak_mib"] = statistics.median(r["peak_mib"] for r in runs)
            row["steps_run"] = runs[-1]["steps_run"]
        losses = first[name].get("losses")
        if eager_losses and losses and len(losses) == len(eager_losses):
            row["max_loss_diff"] = max(
                abs(a - b) for a, b in zip(losses, eager_losses, strict=True)
            )
        row["capture"] = (per[name][-1] if per[name] else first[name]).get("capture")
        if "error" in first[name]:
            row["error"] = first[name]["error"]
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["vs_eager"] = ratio(r.get("steps_per_s"), by.get("eager", {}).get("steps_per_s"))
        r["vs_loom_cg"] = ratio(r.get("steps_per_s"), by.get("loom-cg", {}).get("steps_per_s"))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:  # Lightning's DDP: rank 0 reports
        return 0
    print()
    print(format_table(rows))
    if not args.no_append:
        title = (
            f"Lightning fit, GPT-2 {args.layers}x{args.hidden}, batch {args.batch}x{args.seq}, "
            f"bf16-mixed, {args.devices} device(s)"
        )
        notes = (
            "steps/s: median over interleaved rounds (spread: min-max) of each fit's steps after "
            f"the first {args.skip}; peak_mib: peak allocated during a fit above what was allocated "
            "before it; vs_*: steps/s ratio (higher is faster)."
        )
        print(f"appended to {append_results('trainers', title, rows, notes, device=device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
