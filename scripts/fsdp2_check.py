"""Real FSDP2 (``fully_shard``) compiled with ``backend="loom"`` against eager FSDP2.

Run with two ranks::

    torchrun --nproc-per-node 2 scripts/fsdp2_check.py                 # CUDA + NCCL
    torchrun --nproc-per-node 2 scripts/fsdp2_check.py --device cpu    # gloo smoke run
    torchrun --nproc-per-node 2 scripts/fsdp2_check.py --config traced-ca

A 2-layer transformer is sharded with ``fully_shard`` (each block, then the
root) and trained for ``--steps`` steps with SGD, first eagerly, then compiled
with ``backend="loom"`` under each configuration below. For each
configuration rank 0 prints the losses, the largest gradient difference
against eager (full gradients, gathered), each rank's peak memory against
eager, what the resize passes did (``torchloom.report()``), and a verdict;
a configuration that raises prints the error and the frames that matter.

Configurations (``--config``, default: all):

- ``skipped``: ``torch._dynamo.config.skip_fsdp_hooks=True`` (the 2.11 default),
  compiled autograd off. FSDP2's hooks run eagerly around the compiled blocks
  (graph breaks); the graphs see plain unsharded parameters, no resizes.
- ``skipped-ca``: the same with compiled autograd on for backward.
- ``traced``: ``skip_fsdp_hooks=False``, compiled autograd off. Dynamo traces
  FSDP2's hooks (all-gather, ``resize_``, ``fsdp.copy_``) into the graphs.
- ``traced-ca``: ``skip_fsdp_hooks=False`` with compiled autograd on: the
  "Traceable FSDP2" configuration, the one whose graphs carry the
  ``resize_(full) -> fsdp.copy_ -> resize_(0)`` chains loom_resize removes.

On CPU (``--device cpu``, gloo) ``skipped`` and ``traced`` pass; the ``-ca``
configurations fail in Dynamo (torch 2.11): FSDP2's backward hook enters
``device_handle.stream(...)``, ``torch.cpu.Stream`` on CPU, which Dynamo cannot
trace (see docs/distributed.md). ``scripts/dist_check.py`` checks loom's
features (saved-tensor hooks, DDP, the cache, CUDA graphs) under FSDP2 and DDP.

The process exits 0 when every configuration it ran passed. A configuration
that crashes the process (not an exception) stops the run: its name is the
last "running" line; run the others one by one with ``--config``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

CONFIGS = ("skipped", "skipped-ca", "traced", "traced-ca")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class Transformer(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _sharded_model(dim: int, heads: int, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Transformer(dim, heads).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


@contextlib.contextmanager
def _config(name: str | None, options: dict[str, Any]) -> Iterator[Callable[[nn.Module], Any]]:
    """Dynamo settings of one configuration; yields how to wrap the model."""
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca

    torch._dynamo.reset()
    if name is None:
        yield lambda m: m
        return
    # NOTE: torch 2.15 removed the switch; there the release's behaviour applies.
    has_switch = hasattr(torch._dynamo.config, "skip_fsdp_hooks")
    old = torch._dynamo.config.skip_fsdp_hooks if has_switch else None
    if has_switch:
        torch._dynamo.config.skip_fsdp_hooks = name.startswith("skipped")
    try:
        ctx = (
            ca._enable(torch.compile(backend="loom", options=options, fullgraph=True))
            if name.endswith("-ca")
            else contextlib.nullcontext()
        )
        with ctx:
            yield lambda m: torch.compile(m, backend="loom", options=options)
    finally:
        if has_switch:
            torch._dynamo.config.skip_fsdp_hooks = old
        torch._dynamo.reset()


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            grads.append(torch.zeros(0))
            continue
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads.append(full.detach().float().cpu().clone())
    return grads


def _train(name: str | None, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    options: dict[str, Any] = {"codegen": args.codegen}
    model = _sharded_model(args.dim, args.heads, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    inputs = [
        torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device)
        for _ in range(args.steps)
    ]
    losses, grads = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with _config(name, options) as wrap:
        run = wrap(model)
        for x in inputs:
            loss = run(x).square().mean()
            loss.backward()
            grads.append(_full_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return {"losses": losses, "grads": grads, "peak": peak}


def _report_summary() -> dict[str, Any]:
    import torchloom

    report = torchloom.report()
    resize = report.entries("resize")
    kinds: dict[str, int] = {}
    for e in resize:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    shapes = []
    for g in report:
        codes = dict(g.graphs)
        dyn = codes.get("dynamo") or ""
        fw = codes.get("forward") or codes.get("inference") or ""
        shapes.append(
            f"graph {g.graph_id} ({g.name}): dynamo {dyn.count('resize_storage_bytes_')} resizes, "
            f"{dyn.count('fsdp.copy_')} fsdp.copy_, {dyn.count('all_gather')} all_gather; "
            f"forward after passes {fw.count('resize_storage_bytes_')} resizes"
        )
    return {
        "graph_shapes": shapes,
        "graphs": len(report),
        "fallbacks": [g.fallback for g in report if g.fallback],
        "resize_entries": kinds,
        "resize_messages": [e.message for e in resize][:12],
    }


def _compare(eager: dict[str, Any], got: dict[str, Any], tol: float) -> dict[str, Any]:
    loss_diff = max(abs(a - b) for a, b in zip(eager["losses"], got["losses"], strict=True))
    grad_diff = 0.0
    for ge, gc in zip(eager["grads"], got["grads"], strict=True):
        for a, b in zip(ge, gc, strict=True):
            if a.shape != b.shape:
                return {"loss_diff": loss_diff, "grad_diff": float("inf"), "ok": False}
            if a.numel():
                grad_diff = max(grad_diff, float((a - b).abs().max()))
    return {
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        "ok": loss_diff <= tol and grad_diff <= tol,
    }


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _short_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = text.splitlines()
    frames = [
        f"  at {f.filename}:{f.lineno} in {f.name}"
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" in f.filename or "torchloom" in f.filename or "loom_" in f.filename
    ][-6:]
    return "\n".join(lines[:25] + (["  ..."] if len(lines) > 25 else []) + frames)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config", choices=(*CONFIGS, "all"), default="all")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--codegen", choices=("inductor", "eager"), default=None)
    parser.add_argument("--json", default=None, help="write rank 0's results here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.dim = args.dim or (1024 if cuda else 64)
    args.seq = args.seq or (256 if cuda else 16)
    args.codegen = args.codegen or ("inductor" if cuda else "eager")
    tol = 2e-3 if cuda else 1e-4

    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    import torchloom

    say: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(
        f"torch {torch.__version__}, {dist.get_world_size()} ranks, {device.type}, "
        f"dim {args.dim}, seq {args.seq}, {args.steps} steps, codegen {args.codegen}"
    )
    eager = _train(None, args, device)
    eager_peaks = _gather(eager["peak"])
    say(f"eager      losses {[round(v, 6) for v in eager['losses']]}  peak/rank {eager_peaks}")
    results: dict[str, Any] = {"eager": {"losses": eager["losses"], "peaks": eager_peaks}}
    configs = CONFIGS if args.config == "all" else (args.config,)
    all_ok = True
    for name in configs:
        # NOTE: a crash (not an exception) kills the ranks; this line names the culprit.
        say(f"\n[{name}] running ...")
        torchloom.reset()
        try:
            got = _train(name, args, device)
            error = None
        except Exception as exc:  # report and go on with the next configuration
            got, error = None, _short_error(exc)
        errors = _gather(error)
        if any(errors):
            all_ok = False
            first = next(e for e in errors if e)
            results[name] = {"verdict": "ERROR", "error": first}
            say(f"\n[{name}] ERROR on rank(s) {[i for i, e in enumerate(errors) if e]}:\n{first}")
            continue
        assert got is not None
        cmp = _compare(eager, got, tol)
        peaks = _gather(got["peak"])
        mem_ok = all(
            p is None or e is None or p <= e for p, e in zip(peaks, eager_peaks, strict=True)
        )
        summary = _report_summary()
        verdict = "PASS" if cmp["ok"] and mem_ok and not summary["fallbacks"] else "FAIL"
        all_ok &= verdict == "PASS"
        results[name] = {
            "verdict": verdict,
            **cmp,
            "peaks": peaks,
            "losses": got["losses"],
            **summary,
        }
        ratios = [
            None if p is None or not e else round(p / e, 3)
            for p, e in zip(peaks, eager_peaks, strict=True)
        ]
        say(
            f"\n[{name}] {verdict}: loss max|diff| {cmp['loss_diff']:.2e}, grad max|diff| "
            f"{cmp['grad_diff']:.2e} (tol {tol:g}); peak/rank {peaks} = {ratios} x eager\n"
            f"  losses {[round(v, 6) for v in got['losses']]}\n"
            f"  loom: {summary['graphs']} graphs, fallbacks {summary['fallbacks']}, "
            f"resize {summary['resize_entries']}"
        )
        for line in summary["graph_shapes"] + summary["resize_messages"]:
            say(f"    {line}")
    say(
        "\nverdict: " + ", ".join(f"{k}={v['verdict']}" for k, v in results.items() if k != "eager")
    )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
