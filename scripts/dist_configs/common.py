"""What every configuration of ``dist_check.py`` shares: the command line, the models
and inputs, a training run (:func:`_steps`: losses, full gradients, peak memory), the
verdict against eager (:func:`_compare`, :func:`_agrees`, :func:`_tolerance`), loom's
report and step timing.

A configuration trains the same model once per side from the same seed and inputs and
compares each side with eager; each rank judges its own figures, and the runner
combines the ranks' verdicts."""

from __future__ import annotations

import argparse
import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from fsdp2_check import Transformer, _full_grads
from torch import nn


def _sharded(model: nn.Module, layers: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _transformer(args: argparse.Namespace, device: torch.device, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return Transformer(args.dim, args.heads, layers).to(device)


def _llama(args: argparse.Namespace, device: torch.device) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(64, args.seq),
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return CausalLMLoss(transformers.LlamaForCausalLM(config)).to(device)


class CausalLMLoss(nn.Module):
    """The FSDP2 root: the decoder and its loss, returning the loss alone.

    NOTE: sharding ``LlamaForCausalLM`` itself as the root makes FSDP2 hook every
    tensor of its ``CausalLMOutputWithPast``; under compiled autograd (torch 2.11)
    a tensor pre-hook whose gradient is ``None`` crashes the capture
    (``reorder_tensor_pre_hook_nodes``: ``'NoneType' object has no attribute 'op'``,
    with ``backend="aot_eager"`` too). A root that returns only the loss avoids it.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.lm(input_ids=ids, labels=ids).loss
        return loss


@contextlib.contextmanager
def _dynamo(skip_fsdp_hooks: bool, compiled_autograd: Any = None) -> Iterator[None]:
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca

    torch._dynamo.reset()
    # NOTE: torch 2.15 removed the switch (Dynamo no longer offers to skip FSDP2's
    # hooks); where it is gone the configuration runs with the release's behaviour.
    has_switch = hasattr(torch._dynamo.config, "skip_fsdp_hooks")
    old = torch._dynamo.config.skip_fsdp_hooks if has_switch else None
    if has_switch:
        torch._dynamo.config.skip_fsdp_hooks = skip_fsdp_hooks
    try:
        with ca._enable(compiled_autograd) if compiled_autograd else contextlib.nullcontext():
            yield
    finally:
        if has_switch:
            torch._dynamo.config.skip_fsdp_hooks = old
        torch._dynamo.reset()


def _steps(
    model: nn.Module,
    run: Callable[[Any], torch.Tensor],
    inputs: list[Any],
    opt: torch.optim.Optimizer,
    device: torch.device,
    hooks: tuple[Any, Any] | None = None,
    eager_first: bool = False,
) -> dict[str, Any]:
    """Train ``len(inputs)`` steps; the losses, every step's full gradients, the peak.

    ``eager_first``: the first step runs under ``torch.compiler.set_stance("force_eager")``,
    PyTorch's recipe for traced FSDP2 (its lazy initialization, which creates the unsharded
    ``nn.Parameter``s, runs eagerly; traced, it breaks the graph inside the blocks' loop and
    Dynamo then runs that frame eagerly for good, leaving the forward's all-gathers outside
    every graph)."""
    losses, grads = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        # NOTE: cuBLAS's cached workspaces (tens of MiB on Hopper) count as allocated;
        # the side run before left them, and a CUDA-graph capture clears them: dropped
        # here, each side's peak holds the workspaces its own steps create.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reserved_base = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    for i, x in enumerate(inputs):
        stance = (
            torch.compiler.set_stance("force_eager")
            if eager_first and i == 0
            else contextlib.nullcontext()
        )
        saving = (
            torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
        )
        with stance:
            with saving:
                loss = run(x)
            loss.backward()
        grads.append(_full_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    # NOTE: a CUDA graph's intermediates are reserved in its pool but, after the
    # capture, not counted as allocated: the reserved peak counts them.
    reserved = torch.cuda.max_memory_reserved(device) - reserved_base if cuda else None
    return {"losses": losses, "grads": grads, "peak": peak, "reserved_peak": reserved}


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [
        torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device)
        for _ in range(args.steps)
    ]


#: The largest relative L2 gradient error a configuration without fp8 hooks passes
#: with (rank-wise, over every step); seen: 0 to 5e-5. The absolute tolerance alone
#: passed gradients that were wrong: small gradients (about 1e-3) off by 380 %.
GRAD_REL_TOL = 1e-3


def _agrees(cmp: dict[str, Any], tol: float) -> bool:
    """Whether a :func:`_compare` result is within ``tol`` (losses, gradients) and
    :data:`GRAD_REL_TOL` (the gradients' relative L2 error)."""
    return bool(
        cmp["loss_diff"] <= tol and cmp["grad_diff"] <= tol and cmp["grad_rel"] <= GRAD_REL_TOL
    )


def _tolerance(tol: float) -> str:
    """What :func:`_agrees` bounds, for a result's ``tolerance`` field."""
    return f"abs {tol:g}, grad rel {GRAD_REL_TOL:g}"


def _compare(eager: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Largest absolute loss difference, largest absolute and relative L2 gradient error."""
    loss_diff = max(abs(a - b) for a, b in zip(eager["losses"], got["losses"], strict=True))
    grad_diff, rel = 0.0, 0.0
    for ge, gl in zip(eager["grads"], got["grads"], strict=True):
        num = den = 0.0
        for a, b in zip(ge, gl, strict=True):
            if a.shape != b.shape:
                return {"loss_diff": loss_diff, "grad_diff": float("inf"), "grad_rel": 1.0}
            if a.numel():
                grad_diff = max(grad_diff, float((a - b).abs().max()))
                num += float((a - b).norm() ** 2)
                den += float(a.norm() ** 2)
        rel = max(rel, (num / den) ** 0.5 if den else 0.0)
    return {"loss_diff": loss_diff, "grad_diff": grad_diff, "grad_rel": rel}


def _report() -> dict[str, Any]:
    import torchloom

    report = torchloom.report()
    kinds: dict[str, dict[str, int]] = {}
    for e in report.entries():
        if e.area in ("cache", "hooks", "resize", "cudagraph"):
            area = kinds.setdefault(e.area, {})
            area[e.kind] = area.get(e.kind, 0) + 1
    skips = sorted(
        {
            f"{e.get('kind_', '')}: {e.message}"
            for e in report.entries("cudagraph")
            if e.kind == "skip"
        }
    )
    return {
        "graphs": len(report),
        "fallbacks": [g.fallback for g in report if g.fallback],
        "entries": kinds,
        "cudagraph_skips": skips[:8],
    }


def _transformer_blocks(model: nn.Module) -> Any:
    return model.blocks  # type: ignore[union-attr]


def _time_steps(
    run: Callable[[Any], torch.Tensor],
    x: Any,
    opt: torch.optim.Optimizer,
    device: torch.device,
    n: int,
) -> float | None:
    """Mean milliseconds of ``n`` training steps (forward, backward with DDP's
    all-reduces, SGD step, ``zero_grad``), after the compiling steps; no host read
    of the loss inside the loop."""
    if n <= 0:
        return None
    import time

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # warm: CUDA graphs recorded, allocator settled
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - start) * 1e3 / n


def _say_times(name: str, result: dict[str, Any]) -> None:
    if dist.get_rank() != 0:
        return
    times = ", ".join(
        f"{side} {ms:.2f} ms/step" if ms else f"{side} -" for side, ms in result["step_ms"].items()
    )
    print(f"[{name}] {result['verdict']}: {times}", flush=True)


def _compile_kwargs(args: argparse.Namespace, *, cudagraphs: bool = False) -> dict[str, Any]:
    if args.backend != "loom":  # a PyTorch backend, to tell loom's failures from PyTorch's
        return {"backend": args.backend, **({"mode": "reduce-overhead"} if cudagraphs else {})}
    options: dict[str, Any] = {"codegen": args.codegen}
    if cudagraphs:
        options["cudagraphs"] = True
    return {"backend": "loom", "options": options}


def parse_args(names: Sequence[str], description: str) -> argparse.Namespace:
    """The command line, with the defaults of ``--device`` filled in; ``names``: the
    configurations ``--config`` offers, in their order."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config", choices=(*names, "all"), nargs="+", default=["all"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--eager-first",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=(
            "fsdp2-cudagraphs: run the first step eagerly (PyTorch's recipe for traced FSDP2; "
            "on torch 2.11 every backend's gradients then leave eager's, see docs/distributed.md)"
        ),
    )
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--ddp-layers", type=int, default=4)
    parser.add_argument("--ddp-dim", type=int, default=None)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--backend", default="loom", help="e.g. aot_eager, inductor: a reference")
    parser.add_argument("--codegen", choices=("inductor", "eager"), default=None)
    parser.add_argument("--expect-hits", action="store_true", help="cache: every rank must hit")
    parser.add_argument(
        "--cache-per-rank",
        action="store_true",
        help="cache: each rank uses $TORCHLOOM_CACHE_DIR/rank<N>, a local cache of its own",
    )
    parser.add_argument(
        "--time-steps", type=int, default=None, help="ddp, ddp-cg: timed steps per side"
    )
    parser.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help=(
            "ddp, ddp-cg: skip the PyTorch reference (inductor, reduce-overhead); "
            "fsdp2-step: skip the raw hand-captured graph"
        ),
    )
    parser.add_argument("--json", default=None, help="write rank 0's results here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.steps = args.steps or (5 if cuda else 3)
    args.dim = args.dim or (1024 if cuda else 32)
    args.seq = args.seq or (256 if cuda else 8)
    args.codegen = args.codegen or ("inductor" if cuda else "eager")
    args.time_steps = args.time_steps if args.time_steps is not None else (30 if cuda else 0)
    # NOTE: one block of dim d holds 12 d^2 + 13 d parameters (4 bytes each); a
    # cap of about a block's size puts each block in a bucket of its own. Dynamo's
    # DDP optimizer asserts that DDP's first bucket (1 MiB) is no larger than the
    # others, so the cap is 1 MiB at least and the DDP model wide enough to fill it.
    args.ddp_dim = args.ddp_dim or (1024 if cuda else 160)
    block_mb = (12 * args.ddp_dim**2 + 13 * args.ddp_dim) * 4 / 2**20
    args.bucket_cap_mb = args.bucket_cap_mb or max(1.0, block_mb)
    args.tol = 2e-3 if cuda else 1e-4
    return args
