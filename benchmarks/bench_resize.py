"""FSDP-pattern training step: eager vs ``backend="loom"`` with and without the
resize-chain removal pass, peak memory and step time side by side.

The model is ``loom_resize.FSDPPatternStack``: 8 linear layers of 4096x4096
whose weights have zero storage; each forward gathers a weight (a copy of its
shard stands in for the all-gather), resizes its storage up, fills it with
``copy_``, uses it and frees it. Backward gathers every weight again and frees
each after its gradient is accumulated (the same in every variant). Without
the pass the compiled forward allocates each weight's own storage next to the
gathered buffer, as eager does; with it, the layer reads the gathered buffer.

Reported per variant: the parameter storage the forward allocates (resizes
up left in the compiled forward graph; every weight in eager), the forward's
peak memory above the step's starting point and the whole step's peak (CUDA
only), the median step time, and ratios to eager.

    python benchmarks/bench_resize.py --device cuda
    python benchmarks/bench_resize.py --device cpu --quick --no-append
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import append_results, format_table, parse_args, peak_memory, ratio, time_fn

import torchloom
from loom_resize import FSDPPatternStack


def _variants(codegen: str) -> dict[str, dict[str, Any] | None]:
    return {
        "eager": None,
        "loom": {"codegen": codegen},
        "loom-no-chain-removal": {"codegen": codegen, "resize_remove_chains": False},
    }


def _step(
    model: FSDPPatternStack, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    for w in model.weights:
        w.grad = None
    out = forward(x)
    model.prepare_backward(out)
    out.sum().backward()
    return out.detach()


def _forward_param_allocations(options: dict[str, Any] | None, layers: int, dim: int) -> int:
    """Bytes of parameter storage the forward allocates (its resizes up): every
    layer's weight in eager; in loom, what the compiled forward graph still resizes."""
    if options is None:
        return layers * dim * dim * 4
    codes = [dict(g.graphs).get("forward", "") for g in torchloom.report()]
    return sum(int(n) for code in codes for n in _RESIZE.findall(code or ""))


_RESIZE = re.compile(r"resize_storage_bytes_\.default\(\w+, (\d+)\)")


def _measure(
    name: str, options: dict[str, Any] | None, layers: int, dim: int, x: torch.Tensor, iters: int
) -> tuple[dict[str, Any], torch.Tensor]:
    device = x.device
    torch._dynamo.reset()
    torchloom.reset()
    model = FSDPPatternStack(layers, dim, fill="copy", device=device)
    forward: Callable[[torch.Tensor], torch.Tensor] = (
        model
        if options is None
        else torch.compile(model, backend="loom", options=options, fullgraph=True)
    )
    out = _step(model, forward, x)  # compiles
    fwd_peak = peak_memory(lambda: forward(x).detach(), device)
    for w in model.weights:  # that forward was not followed by a backward
        w.untyped_storage().resize_(0)
    step_peak = peak_memory(lambda: _step(model, forward, x), device)
    timing = time_fn(lambda: _step(model, forward, x), warmup=2, iters=iters, device=device)
    assert model.storage_nbytes() == [0] * layers
    row = {
        "variant": name,
        "fwd_param_alloc_MiB": _forward_param_allocations(options, layers, dim) / 2**20,
        "fwd_peak_MiB": None if fwd_peak is None else fwd_peak / 2**20,
        "step_peak_MiB": None if step_peak is None else step_peak / 2**20,
        "step_ms": timing.median_ms,
    }
    return row, out


def main() -> None:
    args = parse_args(
        "FSDP-pattern step: loom vs eager, with and without resize-chain removal",
        configure=lambda p: p.add_argument(
            "--codegen", choices=("inductor", "eager"), default=None
        ),
    )
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a busy 2-core machine makes OpenMP's spinning threads dominate
    layers, dim, batch = (2, 256, 16) if args.quick else (8, 4096, 64)
    codegen = args.codegen or ("eager" if device.type == "cpu" else "inductor")
    iters = args.iters or (5 if args.quick else 20)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(0)).to(device)
    rows: list[dict[str, Any]] = []
    reference: torch.Tensor | None = None
    for name, options in _variants(codegen).items():
        row, out = _measure(name, options, layers, dim, x, iters)
        reference = out if reference is None else reference
        row["max_abs_diff"] = float((out - reference).abs().max())
        rows.append(row)
    eager = rows[0]
    for row in rows:
        row["fwd_peak_vs_eager"] = ratio(row["fwd_peak_MiB"], eager["fwd_peak_MiB"])
        row["step_vs_eager"] = ratio(row["step_ms"], eager["step_ms"])
    print(format_table(rows))
    if not args.no_append:
        path = append_results(
            "resize",
            f"FSDP-pattern step, {layers} layers of {dim}x{dim}, batch {batch}, codegen {codegen}",
            rows,
            "fill = copy_; loom rewrites it to fsdp.copy_; 'loom' removes the resize/copy/resize chains",
            device=device,
        )
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
