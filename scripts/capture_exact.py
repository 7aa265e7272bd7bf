"""Issue 46's loop, captured against uncaptured: a loom-compiled GPT-2 under DDP.

    torchrun --nproc-per-node 2 scripts/capture_exact.py                # item 1 (+ item 3)
    torchrun --nproc-per-node 2 scripts/capture_exact.py --memory eager,captured
    torchrun --nproc-per-node 2 scripts/capture_exact.py --memory captured   # alone

The loop as a user writes it: a Hugging Face GPT-2 from a config (4 layers, width
256, 4 heads, vocab 4096, no dropout), batch 8 x 128 tokens per rank, ``DDP(model)``
then ``torch.compile(ddp, backend="loom")``, ``cross_entropy`` on the logits outside
the model under bf16 autocast, ``AdamW(lr=<tensor>, capturable=True,
weight_decay=0.1)`` with a warm-up + cosine schedule set by ``lr.fill_()`` before
each step, ``clip_grad_norm_(..., 1.0)`` returned with the loss,
``zero_grad(set_to_none=True)``.

Each case trains three copies in lockstep for ``--steps`` steps: ``captured`` (the
step under ``torchloom.capture_step``), ``eager`` and ``eager2`` (uncaptured). After
every step: per parameter, max |a - b| / max |b| against ``eager``; the largest over
parameters for captured and for eager2 (the noise). Cases (``--cases``):

- ``default``: DDP built on the default stream;
- ``side``: DDP built on a side stream;
- ``no-rehearse``: ``default`` with every warm-up told the truth (no capture) about
  ``is_current_stream_capturing()`` (the issue's suspect);
- ``warm-only``: ``default`` never captured (every call a warm-up on capture_step's
  stream, after its DDP rebuild): captured-vs-eager here is what the stream and the
  rebuild do, without a capture;
- ``eager-model``: ``default`` with the model not compiled (the control: bitwise).

Rank 0 prints ``EXACT {json}`` per case: the final and worst ratios, the first step
where captured exceeds 2x the noise so far, the loss difference, capture_step's
stats. ``--memory``: the loop alone per mode, in this order in this process, with
``max_memory_allocated`` / ``max_memory_reserved`` per rank (``MEMORY {json}``).
Every rank counts the sync warnings C++ printed to its stderr (item 3): run with
``2> >(tee stderr.txt)`` and grep "synchronizing".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

CASES = ("default", "side", "no-rehearse", "warm-only", "eager-model")


def _schedule(i: int, total: int, peak: float = 1e-3, warm: int = 4) -> float:
    if i < warm:
        return peak * (i + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm)))


class Copy:
    """One copy of the loop: model, DDP, optimizer, lr tensor, step."""

    def __init__(self, args: argparse.Namespace, device: torch.device, case: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=args.seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(cfg).to(device)
        if case == "side":
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.ddp = DDP(self.model)
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.ddp = DDP(self.model)
        self.run = self.ddp if case == "eager-model" else torch.compile(self.ddp, backend="loom")
        self.lr = torch.tensor(1e-3, device=device)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, capturable=True, weight_decay=0.1
        )
        self.names = [n for n, _ in self.model.named_parameters()]

    def step_fn(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        run, opt, params = self.run, self.opt, list(self.model.parameters())

        def train_step(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = run(input_ids=ids).logits
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
                )
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach(), norm

        return train_step


def _batches(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    shape = (args.batch, args.seq)
    return [torch.randint(0, 4096, shape, generator=g).to(device) for _ in range(args.steps)]


def _worst(a: torch.nn.Module, b: torch.nn.Module, names: list[str]) -> tuple[float, str]:
    out = []
    for n, p, q in zip(names, a.parameters(), b.parameters(), strict=True):
        rel = float((p.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12))
        out.append((rel, n))
    return max(out)


@contextlib.contextmanager
def _case_setup(case: str) -> Any:
    """``no-rehearse``: warm-ups answer ``is_current_stream_capturing()`` truthfully."""
    if case != "no-rehearse":
        yield
        return
    import loom_step._step as step_module

    saved = step_module.compat.rehearsing_capture
    step_module.compat.rehearsing_capture = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        step_module.compat.rehearsing_capture = saved  # type: ignore[assignment]


def run_case(case: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import torchloom

    torchloom.reset()
    copies = [Copy(args, device, case) for _ in range(3)]
    options: dict[str, Any] = {"capture_step_warmup": 10**6} if case == "warm-only" else {}
    with _case_setup(case):
        captured = torchloom.capture_step(copies[0].step_fn(), **options)
        fns = [captured, copies[1].step_fn(), copies[2].step_fn()]
        cap_series, noise_series, first_over, loss_diff = [], [], None, 0.0
        noise_max = 0.0
        for i, ids in enumerate(_batches(args, device)):
            for c in copies:
                c.lr.fill_(_schedule(i, args.steps))
            outs = [fn(ids) for fn in fns]
            loss_diff = max(loss_diff, abs(float(outs[0][0]) - float(outs[1][0])))
            cap, cap_name = _worst(copies[0].model, copies[1].model, copies[1].names)
            noise, _ = _worst(copies[2].model, copies[1].model, copies[1].names)
            noise_max = max(noise_max, noise)
            cap_series.append(round(cap, 7))
            noise_series.append(round(noise, 7))
            if first_over is None and cap > 2 * noise_max:
                first_over = {"step": i, "param": cap_name, "cap": cap, "noise_max": noise_max}
    stats = captured.stats()
    return {
        "case": case,
        "captured_vs_eager": cap_series[-1],
        "noise": noise_series[-1],
        "ratio": cap_series[-1] / max(noise_series[-1], 1e-12),
        "worst_captured": max(cap_series),
        "worst_noise": max(noise_series),
        "first_step_over_2x_noise": first_over,
        "loss_max_abs_diff": loss_diff,
        "per_step": list(zip(cap_series, noise_series, strict=True)),
        "stats": stats.format(),
    }


def run_memory(mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The loop alone (one copy), eager or captured: peak allocated and reserved."""
    import torchloom

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    copy = Copy(args, device, "default")
    fn = copy.step_fn()
    if mode == "captured":
        fn = torchloom.capture_step(fn)
    for i, ids in enumerate(_batches(args, device)):
        copy.lr.fill_(_schedule(i, args.steps))
        fn(ids)
    torch.cuda.synchronize()
    mib = 2**20
    row = {
        "mode": mode,
        "rank": dist.get_rank(),
        "max_allocated_mib": round(torch.cuda.max_memory_allocated() / mib, 1),
        "max_reserved_mib": round(torch.cuda.max_memory_reserved() / mib, 1),
        "allocated_end_mib": round(torch.cuda.memory_allocated() / mib, 1),
        "reserved_end_mib": round(torch.cuda.memory_reserved() / mib, 1),
    }
    if mode == "captured":
        row["pool_mib"] = round(fn.stats().pool_bytes / mib, 1)  # type: ignore[attr-defined]
    del copy, fn
    gc.collect()
    torch.cuda.synchronize()
    # what the loop leaves allocated once its objects are gone (the next mode starts on it)
    row["left_after_del_mib"] = round(torch.cuda.memory_allocated() / mib, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--memory", default=None, help="comma-separated modes: eager,captured")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    if args.memory:
        for mode in args.memory.split(","):
            rows: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(rows, run_memory(mode, args, device))
            if rank == 0:
                print("MEMORY " + json.dumps(rows), flush=True)
    else:
        for case in args.cases:
            result = run_case(case, args, device)
            results: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(results, {k: result[k] for k in result if k != "per_step"})
            if rank == 0:
                print("EXACT " + json.dumps({**result, "ranks": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
