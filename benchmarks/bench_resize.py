"""FSDP-pattern training step: eager vs ``backend="loom"`` with and without the
resize-chain removal pass and with compiled autograd, peak memory and step
time side by side.

The model is ``loom_resize.FSDPPatternStack``: 8 linear layers of 4096x4096
whose weights have zero storage; each forward gathers a weight (a copy of its
shard stands in for the all-gather), resizes its storage up, fills it with
``copy_``, uses it and frees it. Backward gathers every weight again and frees
each after its gradient is accumulated (the same in every variant). Without
the pass the compiled forward allocates each weight's own storage next to the
gathered buffer, as eager does; with it, the layer reads the gathered buffer.

Without compiled autograd the compiled backward is one autograd node that
returns every weight gradient at once; the post-accumulate-grad hooks that free
the weights run after it, so the step's peak holds every gathered weight and
every gradient together (eager frees each weight as its gradient lands).
"+ compiled autograd" traces those hooks into the backward graph
(``compiled_autograd._enable(torch.compile(backend="loom", fullgraph=True))``),
so each weight is freed right after its gradient. "+ reduce" is FSDP2's way:
each post-accumulate-grad hook reduces the full gradient into a shard and drops
it (``FSDPPatternStack(reduce_grads=True)``).

Reported per variant: the parameter storage the forward allocates (resizes
up left in the compiled forward graph; every weight in eager), the forward's
peak memory above its starting point and the whole step's peak above its
start, the previous step's gradients dropped before it and no compile inside it (CUDA:
the caching allocator's counters; CPU: the profiler's allocation events), the
median step time, the largest differences of output and weight gradients from
eager, and ratios to eager.

    python benchmarks/bench_resize.py --device cuda
    python benchmarks/bench_resize.py --device cpu --quick --no-append
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import append_results, format_table, parse_args, peak_memory, ratio, time_fn

import torchloom
from loom_resize import FSDPPatternStack


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    options: dict[str, Any] | None  # None: eager
    compiled_autograd: bool = False
    reduce_grads: bool = False


def _variants(codegen: str) -> list[Variant]:
    loom = {"codegen": codegen}
    variants = [
        Variant("eager", None),
        Variant("loom", loom),
        Variant("loom-no-chain-removal", {**loom, "resize_remove_chains": False}),
        Variant("loom + compiled autograd", loom, compiled_autograd=True),
        Variant("eager + reduce", None, reduce_grads=True),
        Variant(
            "loom + compiled autograd + reduce", loom, compiled_autograd=True, reduce_grads=True
        ),
    ]
    if codegen != "eager":
        # NOTE: eager codegen runs the compiled-autograd backward's ops in graph
        # order: the schedule compiled autograd chose, without Inductor's.
        eager = {"codegen": "eager"}
        variants += [
            Variant("loom + compiled autograd, eager codegen", eager, compiled_autograd=True),
            Variant(
                "loom + compiled autograd + reduce, eager codegen",
                eager,
                compiled_autograd=True,
                reduce_grads=True,
            ),
        ]
    return variants


def _compiled_autograd(variant: Variant) -> contextlib.AbstractContextManager[Any]:
    if not variant.compiled_autograd:
        return contextlib.nullcontext()
    import torch._dynamo.compiled_autograd as compiled_autograd

    backward = torch.compile(backend="loom", options=variant.options, fullgraph=True)
    return compiled_autograd._enable(backward)


def _step(
    model: FSDPPatternStack, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    for w in model.weights:
        w.grad = None
    out = forward(x)
    model.prepare_backward(out)
    out.sum().backward()
    return out.detach()


def _step_grads(
    model: FSDPPatternStack, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step's output and weight gradients (reduced into the shards, or in ``.grad``)."""
    if not model.reduce_grads:
        out = _step(model, forward, x)
        return out, [w.grad.detach().clone() for w in model.weights if w.grad is not None]
    for i in range(len(model.weights)):
        model.grad_shard(i).zero_()
    out = _step(model, forward, x)
    return out, [model.grad_shard(i).clone() for i in range(len(model.weights))]


def _peak(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak bytes allocated during ``fn`` above its start: the caching
    allocator's counters on CUDA, the profiler's allocation events on CPU."""
    if device.type == "cuda":
        return peak_memory(fn, device)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not events:
        return None
    events.sort()
    start = events[0][2] - events[0][1]  # each event carries the running total after it
    return max(total for _, _, total in events) - start


def _compiles() -> tuple[int, int]:
    """Compiled-autograd captures and Dynamo graphs compiled so far."""
    from torch._dynamo.utils import counters

    return counters["compiled_autograd"]["captures"], counters["stats"]["unique_graphs"]


def _forward_param_allocations(options: dict[str, Any] | None, layers: int, dim: int) -> int:
    """Bytes of parameter storage the forward allocates (its resizes up): every
    layer's weight in eager; in loom, what the compiled forward graph still resizes."""
    if options is None:
        return layers * dim * dim * 4
    codes = [dict(g.graphs).get("forward", "") for g in torchloom.report()]
    return sum(int(n) for code in codes for n in _RESIZE.findall(code or ""))


_RESIZE = re.compile(r"resize_storage_bytes_\.default\(\w+, (\d+)\)")


def _measure(
    variant: Variant, layers: int, dim: int, x: torch.Tensor, iters: int
) -> tuple[dict[str, Any], tuple[torch.Tensor, list[torch.Tensor]]]:
    device = x.device
    torch._dynamo.reset()
    torchloom.reset()
    model = FSDPPatternStack(
        layers, dim, fill="copy", device=device, reduce_grads=variant.reduce_grads
    )
    forward: Callable[[torch.Tensor], torch.Tensor] = (
        model
        if variant.options is None
        else torch.compile(model, backend="loom", options=variant.options, fullgraph=True)
    )
    with _compiled_autograd(variant):
        _step(model, forward, x)  # compiles
        fwd_peak = _peak(lambda: forward(x).detach(), device)
        for w in model.weights:  # that forward was not followed by a backward
            w.untyped_storage().resize_(0)
        for w in model.weights:  # the step's peak, not the previous step's gradients
            w.grad = None
        compiled = _compiles()
        step_peak = _peak(lambda: _step(model, forward, x), device)
        # a compile inside the measured step (a compiled-autograd cache miss,
        # say) would put its own allocations into the peak
        assert _compiles() == compiled, f"{variant.name}: the measured step compiled"
        timing = time_fn(lambda: _step(model, forward, x), warmup=2, iters=iters, device=device)
        result = _step_grads(model, forward, x)
    assert model.storage_nbytes() == [0] * layers
    assert all(w.grad is None for w in model.weights) or not variant.reduce_grads
    fallbacks = [g.fallback for g in torchloom.report() if g.fallback is not None]
    assert not fallbacks, f"{variant.name} fell back to eager: {fallbacks}"
    row = {
        "variant": variant.name,
        "fwd_param_alloc_MiB": _forward_param_allocations(variant.options, layers, dim) / 2**20,
        "fwd_peak_MiB": None if fwd_peak is None else fwd_peak / 2**20,
        "step_peak_MiB": None if step_peak is None else step_peak / 2**20,
        "step_ms": timing.median_ms,
    }
    return row, result


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
    layers, dim, batch = (4, 256, 16) if args.quick else (8, 4096, 64)
    codegen = args.codegen or ("eager" if device.type == "cpu" else "inductor")
    iters = args.iters or (5 if args.quick else 20)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(0)).to(device)
    rows: list[dict[str, Any]] = []
    reference: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    for variant in _variants(codegen):
        try:
            row, (out, grads) = _measure(variant, layers, dim, x, iters)
        except Exception as error:  # reported in the table; the other variants still run
            message = (str(error).strip().splitlines() or [""])[0].replace("|", "/")
            traceback.print_exc()
            print(f"!!! {variant.name}: {type(error).__name__}: {message}", file=sys.stderr)
            rows.append({"variant": variant.name, "error": f"{type(error).__name__}: {message}"})
            continue
        reference = reference or (out, grads)
        row["max_abs_diff"] = float((out - reference[0]).abs().max())
        assert len(grads) == len(reference[1]) == layers
        row["max_grad_diff"] = max(
            float((g - r).abs().max()) for g, r in zip(grads, reference[1], strict=True)
        )
        rows.append(row)
    eager = rows[0]
    for row in rows:
        row["fwd_peak_vs_eager"] = ratio(row.get("fwd_peak_MiB"), eager["fwd_peak_MiB"])
        row["step_peak_vs_eager"] = ratio(row.get("step_peak_MiB"), eager["step_peak_MiB"])
        row["step_vs_eager"] = ratio(row.get("step_ms"), eager["step_ms"])
    print(format_table(rows))
    if not args.no_append:
        path = append_results(
            "resize",
            f"FSDP-pattern step, {layers} layers of {dim}x{dim}, batch {batch}, codegen {codegen}",
            rows,
            "fill = copy_; loom rewrites it to fsdp.copy_; 'loom' removes the resize/copy/resize "
            "chains; '+ compiled autograd' traces the backward hooks into the backward graph; "
            "'+ reduce' reduces each gradient into a shard in its post-accumulate-grad hook; "
            f"peaks: {'CUDA caching allocator' if device.type == 'cuda' else 'CPU profiler allocation events'}",
            device=device,
        )
        print(f"appended to {path}")
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
