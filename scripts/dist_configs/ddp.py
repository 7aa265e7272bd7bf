"""``torch.compile(DDP(model))`` with loom: Dynamo's DDP optimizer, one graph per bucket.

Configurations (``--config``):

- ``ddp``: ``torch.compile(DDP(model, bucket_cap_mb=small), backend="loom")``
  with ``--codegen`` (Inductor on CUDA, the default options; eager on CPU).
  Dynamo's DDP optimizer splits the graph at the gradient-bucket boundaries,
  so loom compiles one graph per bucket; losses and gradients must equal
  eager DDP's and loom must have compiled more than one graph. On CUDA
  ``backend="inductor"`` runs the same model as the reference, and each side's
  mean step time over ``--time-steps`` steps is printed
  (``[ddp] PASS: eager ... ms/step, loom ..., inductor ...``) and reported
  (``step_ms``, ``loom_vs_inductor``: below 1.0 is faster).
- ``ddp-cg`` (GPU only): the same with ``options={"cudagraphs": True}``
  against ``backend="inductor", mode="reduce-overhead"`` (``loom_vs_reduce-overhead``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from fsdp2_check import Transformer, _short_error
from torch import nn

from .common import (
    _agrees,
    _compare,
    _compile_kwargs,
    _dynamo,
    _report,
    _say_times,
    _steps,
    _time_steps,
    _tolerance,
)
from .registry import register


def _ddp_sequential(
    args: argparse.Namespace,
    device: torch.device,
    variants: tuple[str, ...] = ("outer_compiled", "inner_compiled"),
) -> dict[str, Any]:
    """``torch.compile(DDP(nn.Sequential))`` against ``DDP(torch.compile(nn.Sequential))``.

    Dynamo does not trace DDP's own forward: it graph-breaks at
    ``DistributedDataParallel._inside_ddp_forward`` (a function marked skipped) and
    compiles the wrapped module's forward as a frame of its own, with the DDP
    optimizer active. When that forward is torch.nn code (``nn.Sequential``), the
    frame is skipped too and nothing is compiled. Compiling the inner module and
    wrapping the result in DDP runs the same split (the DDP optimizer applies to
    frames run inside DDP's forward).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchloom

    width = 512  # each Linear just over 1 MiB: a bucket of its own at bucket_cap_mb=1
    ids = [device.index] if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(400 + dist.get_rank())
    inputs = [torch.randn(args.batch, width, generator=gen).to(device) for _ in range(args.steps)]
    out: dict[str, Any] = {}
    sides = {}
    for side in ("eager", *variants):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) for _ in range(3)]
        seq = nn.Sequential(*(m for layer in layers for m in (layer, nn.GELU()))).to(device)
        inner = torch.compile(seq, **_compile_kwargs(args)) if side == "inner_compiled" else seq
        ddp = DDP(inner, device_ids=ids, bucket_cap_mb=1)
        run = torch.compile(ddp, **_compile_kwargs(args)) if side == "outer_compiled" else ddp
        torchloom.reset()
        with _dynamo(skip_fsdp_hooks=True):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            sides[side] = _steps(seq, lambda x, r=run: r(x).square().mean(), inputs, opt, device)
            graphs = len(torchloom.report())
        if side != "eager":
            cache = _report()["entries"].get("cache", {})
            out[side] = {"graphs": graphs, "cache": cache, **_compare(sides["eager"], sides[side])}
    return out


def _ddp_sides(
    args: argparse.Namespace,
    device: torch.device,
    sides: dict[str, dict[str, Any] | None],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Train the same DDP transformer once per side (``None``: eager DDP, else the
    ``torch.compile`` keywords of ``torch.compile(DDP(model))``): each side's losses,
    gradients, step time (``step_ms``) or error; and loom's report and split."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchloom

    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    inputs = [
        torch.randn(args.batch, args.seq, args.ddp_dim, generator=gen).to(device)
        for _ in range(args.steps)
    ]
    ids = [device.index] if device.type == "cuda" else None
    out: dict[str, dict[str, Any]] = {}
    loom: dict[str, Any] = {}
    for side, kwargs in sides.items():
        torch.manual_seed(0)
        model = Transformer(args.ddp_dim, args.heads, args.ddp_layers).to(device)
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torchloom.reset()
        with _dynamo(skip_fsdp_hooks=True):
            assert torch._dynamo.config.optimize_ddp, "Dynamo's DDP optimizer is off"
            before = int(counters["stats"].get("unique_graphs", 0))
            run = ddp if kwargs is None else torch.compile(ddp, **kwargs)
            try:
                got = _steps(ddp, lambda x, r=run: r(x).square().mean(), inputs, opt, device)
                got["step_ms"] = _time_steps(run, inputs[-1], opt, device, args.time_steps)
            except Exception as exc:  # a reference backend may fail: say so, go on
                if side == args.backend:
                    raise
                got = {"error": _short_error(exc)}
            splits = int(counters["stats"].get("unique_graphs", 0)) - before
        if side == args.backend:
            loom = {
                "dynamo_unique_graphs": splits,
                "ddp_buckets": len(ddp.reducer._get_zeros_like_grad_buckets()),
                **_report(),
            }
        out[side] = got
    return out, loom


def _ddp_verdict(
    args: argparse.Namespace, out: dict[str, dict[str, Any]], loom: dict[str, Any], compared: str
) -> dict[str, Any]:
    """Every side against eager DDP; loom's step time against ``compared``'s."""
    result: dict[str, Any] = {}
    for side, got in out.items():
        if side == "eager":
            continue
        result[side] = {"error": got["error"]} if "error" in got else _compare(out["eager"], got)
    main = args.backend
    cmp = result[main]
    ok = _agrees(cmp, args.tol) and (
        args.backend != "loom" or (loom["graphs"] > 1 and not loom["fallbacks"])
    )
    step_ms = {side: got.get("step_ms") for side, got in out.items()}
    ratio = None
    if step_ms.get(main) and step_ms.get(compared) and main != compared:
        ratio = step_ms[main] / step_ms[compared]
    return {
        "ok": ok,
        "step_ms": step_ms,
        f"loom_vs_{compared}": ratio,
        "sides": result,
        "eager_losses": out["eager"]["losses"],
        "losses": out[main]["losses"],
        **cmp,
    }


@register("ddp", order=40)
def run_ddp(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``torch.compile(DDP(model), backend="loom")`` with ``--codegen`` (Inductor on
    CUDA), against eager DDP and ``backend="inductor"`` (``--backend`` instead of
    loom: that backend on both sides)."""
    reference = "inductor" if args.backend == "loom" else args.backend
    sides: dict[str, dict[str, Any] | None] = {"eager": None, args.backend: _compile_kwargs(args)}
    if args.reference and device.type == "cuda" and args.backend == "loom":
        sides[reference] = {"backend": reference}
    out, loom = _ddp_sides(args, device, sides)
    verdict = _ddp_verdict(args, out, loom, reference)
    sequential = _ddp_sequential(args, device)
    ok = verdict.pop("ok") and _agrees(sequential["inner_compiled"], args.tol)
    result = {
        "verdict": "PASS" if ok else "FAIL",
        "backend": args.backend,
        "codegen": args.codegen if args.backend == "loom" else None,
        "tolerance": _tolerance(args.tol),
        "bucket_cap_mb": args.bucket_cap_mb,
        "sequential": sequential,
        **verdict,
        **loom,
    }
    _say_times("ddp", result)
    return result


@register("ddp-cg", order=50, gpu_only=True)
def run_ddp_cg(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """GPU only: ``torch.compile(DDP(model), backend="loom", options={"cudagraphs":
    True})`` against eager DDP and ``backend="inductor", mode="reduce-overhead"``."""
    if device.type != "cuda":
        return {"verdict": "SKIP", "reason": "GPU only: CUDA graphs need CUDA devices and NCCL"}
    reference = "reduce-overhead"
    sides: dict[str, dict[str, Any] | None] = {
        "eager": None,
        args.backend: _compile_kwargs(args, cudagraphs=True),
    }
    if args.reference and args.backend == "loom":
        sides[reference] = {"backend": "inductor", "mode": "reduce-overhead"}
    out, loom = _ddp_sides(args, device, sides)
    verdict = _ddp_verdict(args, out, loom, reference)
    ok = verdict.pop("ok")
    cg = loom["entries"].get("cudagraph", {})
    result = {
        "verdict": "PASS" if ok else "FAIL",
        "backend": args.backend,
        "codegen": args.codegen if args.backend == "loom" else None,
        "captured": cg.get("recording", 0) > 0,
        **verdict,
        **loom,
    }
    _say_times("ddp-cg", result)
    return result
