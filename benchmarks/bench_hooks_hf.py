"""Saved-tensor hooks on Hugging Face decoders (Llama, GPT-2 from configs): memory, time, compiles.

Training steps (forward with ``labels``, backward) of ``LlamaForCausalLM`` and
``GPT2LMHeadModel`` built from configs with random weights (nothing is
downloaded), fp32 (TF32 matmuls on CUDA: the step time, not the memory, is
what that changes). Rows, per model:

- ``no hooks``;
- ``fp8 hooks``: delayed-scaling style fp8 hooks whose closure ``scale`` (a
  Python float) is new at every step; float32 tensors of at least 4096
  elements are stored as ``float8_e4m3fn`` (``(t * scale)`` clamped to the fp8
  range), smaller ones and integer tensors as they are;
- ``fp8 hooks + ckpt``: the same with ``gradient_checkpointing_enable()``
  (non-reentrant), what LLM training combines;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu()`` (pinned on CUDA)
  entered anew each step.

Columns (backends): ``eager``, ``inductor`` (hooks run on the compiled
function's saved tensors after its forward) and ``loom`` (hooks placed in the
graph). For each: ``peak_mib`` (CUDA: the peak allocated during one warm step
above what was allocated before it; none on CPU), ``step_ms`` (median of the
timed steps), ``compiles`` (graphs Dynamo handed to the backend over the first
10 steps, each with its own scale; recompiles count) and ``recompiles`` (those
after the first step), ``placed`` (loom: graphs with the hooks placed /
graphs compiled) and ``grad_rel_err`` (the first step's gradients against
eager with the same hooks; lossy hooks differ where the compiled partition saves
other tensors than eager). ``peak_vs_eager`` and ``peak_vs_inductor`` compare a
row's peak with the same row under eager and Inductor. A cell that raises is
a row with its ``error``; the others still run.

The default CUDA size (4 layers of hidden 1024, vocab 2048, batch 4 x 1024
tokens) makes the saved activations (~0.9 GiB per step without hooks) dominate
the logits and the weights, within about 4 minutes for the 16 compiled cells.
With checkpointing the peak is the backward's recomputation of one layer in
every backend at this depth; Inductor's cost of packing after the forward
(every checkpointed layer's input kept in fp32 until the forward ends) grows
with the layers, so the checkpointing row separates the backends on deeper
models (``--layers 16 --models llama --rows "fp8 hooks + ckpt"``: two compiles).

    python benchmarks/bench_hooks_hf.py --device cuda              # about 4 minutes on an H100
    python benchmarks/bench_hooks_hf.py --device cpu --quick --no-append   # smoke run
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, peak_memory, ratio, time_fn

import torchloom

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FP8_MAX = 448.0
MIB = 2**20
WARM_STEPS = 10  # steps with a changing scale over which compiles are counted
ROWS = ("no hooks", "fp8 hooks", "fp8 hooks + ckpt", "save_on_cpu")


# -- hooks ----------------------------------------------------------------------------


class DelayedFp8:
    """fp8 saved-tensor hooks whose closure scale is set per step (delayed scaling)."""

    def __init__(self, min_numel: int = 4096) -> None:
        self.min_numel = min_numel
        self.scale = 1.0

    def pair(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        scale, min_numel = self.scale, self.min_numel

        def pack(t: torch.Tensor) -> Any:
            if t.dtype != torch.float32 or t.numel() < min_numel:
                return (None, t)
            q = (t * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return (t.dtype, q)

        def unpack(p: Any) -> torch.Tensor:
            dtype, q = p
            if dtype is None:
                return q  # type: ignore[no-any-return]
            return (q.to(torch.float32) / scale).to(dtype)  # type: ignore[no-any-return]

        return pack, unpack

    @contextlib.contextmanager
    def active(self, step: int) -> Iterator[None]:
        # the step's scale: a new float every step (a guard on its value would
        # compile once per step, up to the variant limit)
        self.scale = 8.0 + 0.25 * step
        with torch.autograd.graph.saved_tensors_hooks(*self.pair()):
            yield


def hooks_context(row: str, device: str) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
    if row.startswith("fp8"):
        return DelayedFp8().active
    if row == "save_on_cpu":
        pin = device == "cuda"
        return lambda step: torch.autograd.graph.save_on_cpu(pin_memory=pin)
    return lambda step: contextlib.nullcontext()


# -- models ---------------------------------------------------------------------------


def build(name: str, size: dict[str, int]) -> torch.nn.Module:
    import transformers

    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=size["vocab"],
            hidden_size=size["hidden"],
            intermediate_size=size["hidden"] * 11 // 4,
            num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"],
            num_key_value_heads=size["heads"] // 2,
            max_position_embeddings=size["seq"],
            attention_dropout=0.0,
            use_cache=False,
            attn_implementation="sdpa",
        )
        config.loss_type = "ForCausalLM"  # unset, transformers logs a warning: a graph break
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=size["vocab"],
        n_positions=size["seq"],
        n_embd=size["hidden"],
        n_layer=size["layers"],
        n_head=size["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    config.loss_type = "ForCausalLM"
    return transformers.GPT2LMHeadModel(config)


def enable_checkpointing(model: torch.nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


# -- one cell of the table -------------------------------------------------------------


def graphs_compiled() -> int:
    """Graphs Dynamo handed to a backend since the last reset (recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_cell(
    model_name: str, row: str, backend: str, size: dict[str, int], device: str, iters: int
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One (model, row, backend) cell, and its first step's gradients (on the CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torchloom.reset()
    torch.manual_seed(0)
    model = build(model_name, size).to(device).train()
    if row.endswith("ckpt"):
        enable_checkpointing(model)
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = loss_of
    if backend == "inductor":
        forward = torch.compile(loss_of, backend="inductor")
    elif backend == "loom":
        options = {} if device == "cuda" else {"codegen": "eager"}
        forward = torch.compile(loss_of, backend="loom", options=options)
    context = hooks_context(row, device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen).to(device)
    counter = [0]

    def step() -> float:
        model.zero_grad(set_to_none=True)
        with context(counter[0]):
            loss = forward(model, ids)
            loss.backward()
        counter[0] += 1
        return float(loss.detach())

    before = graphs_compiled()
    step()
    after_first = graphs_compiled()
    grads = [p.grad.detach().to("cpu", copy=True) for p in model.parameters() if p.grad is not None]
    for _ in range(WARM_STEPS - 1):
        step()
    compiles = graphs_compiled() - before
    peak = peak_memory(step, device)
    timing = time_fn(step, warmup=0, iters=iters, device=device)
    compiled = backend != "eager"
    cell: dict[str, Any] = {
        "model": model_name,
        "row": row,
        "backend": backend,
        "peak_mib": None if peak is None else peak / MIB,
        "step_ms": timing.median_ms,
        "compiles": compiles if compiled else None,
        "recompiles": graphs_compiled() - after_first if compiled else None,
    }
    if backend == "loom":
        report = torchloom.report()
        placed = [g for g in report if any(e.kind == "placed" for e in g.entries)]
        cell["placed"] = f"{len(placed)}/{len(report)}" if row != "no hooks" else None
    return cell, grads


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Relative L2 error of the first step's gradients against eager's (same hooks)."""
    num = sum(float((a.double() - b.double()).norm() ** 2) for a, b in zip(got, want, strict=True))
    den = sum(float(b.double().norm() ** 2) for b in want)
    return (num / max(den, 1e-30)) ** 0.5


def _release(device: str) -> None:
    """Drop what a cell left (compiled code, its model, cached blocks) before the next."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        configure=lambda p: (
            p.add_argument("--models", default="llama,gpt2", help="comma list: llama, gpt2"),
            p.add_argument(
                "--backends",
                default=None,
                help="comma list of eager, inductor, loom (default: all on CUDA; "
                "eager,loom on CPU, where Inductor compiles take minutes)",
            ),
            p.add_argument("--rows", default=",".join(ROWS), help="comma list of rows"),
            p.add_argument("--layers", type=int, default=None, help="decoder layers"),
            p.add_argument("--batch", type=int, default=None, help="sequences per step"),
        ),
    )
    device = args.device
    cuda = device == "cuda"
    if cuda and not args.quick:
        size = {"vocab": 2048, "hidden": 1024, "layers": 4, "heads": 16, "seq": 1024, "batch": 4}
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        size = {"vocab": 128, "hidden": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 2}
    size["layers"] = args.layers or size["layers"]
    size["batch"] = args.batch or size["batch"]
    backends = (args.backends or ("eager,inductor,loom" if cuda else "eager,loom")).split(",")
    rows_wanted = [r for r in args.rows.split(",") if r]
    # NOTE: parse_args defaults --iters to 50; ten timed steps per cell are enough here.
    iters = args.iters if "--iters" in sys.argv[1:] else (3 if args.quick else 10)
    cells: list[dict[str, Any]] = []
    started = time.perf_counter()
    for model_name in args.models.split(","):
        for row in rows_wanted:
            eager_grads: list[torch.Tensor] | None = None
            for backend in backends:
                try:
                    cell, grads = run_cell(model_name, row, backend, size, device, iters)
                except Exception as e:  # a failing cell is a row: the table goes on
                    cell = {"model": model_name, "row": row, "backend": backend}
                    cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    grads = None
                if backend == "eager":
                    eager_grads = grads
                elif grads is not None and eager_grads is not None:
                    cell["grad_rel_err"] = rel_err(grads, eager_grads)
                del grads
                _release(device)
                cells.append(cell)
                elapsed = time.perf_counter() - started
                print(f"[{elapsed:6.1f} s] " + format_table([cell]), flush=True)
    for cell in cells:
        same = [c for c in cells if (c["model"], c["row"]) == (cell["model"], cell["row"])]
        ref = {c["backend"]: c for c in same}
        eager, inductor = ref.get("eager"), ref.get("inductor")
        peak = cell.get("peak_mib")
        cell["peak_vs_eager"] = ratio(peak, eager and eager.get("peak_mib"))
        cell["peak_vs_inductor"] = ratio(peak, inductor and inductor.get("peak_mib"))
    columns = [
        "model",
        "row",
        "backend",
        "peak_mib",
        "step_ms",
        "compiles",
        "recompiles",
        "placed",
        "grad_rel_err",
        "peak_vs_eager",
        "peak_vs_inductor",
        "error",
    ]
    cells = [{k: c.get(k) for k in columns if any(k in x for x in cells)} for c in cells]
    print(format_table(cells))
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    notes = (
        f"HF decoders from configs, fp32 (TF32 matmuls on CUDA): hidden {size['hidden']}, "
        f"{size['layers']} layers, {size['heads']} heads, vocab {size['vocab']}, batch "
        f"{size['batch']} x seq {size['seq']}; one step = forward with labels + backward. "
        f"compiles: graphs compiled over {WARM_STEPS} steps whose fp8 scale is new every "
        "step (recompiles: after the first step); peak: one warm step above what was "
        "allocated before it; placed: loom graphs with the hooks placed / graphs compiled."
    )
    if not args.no_append:
        append_results("hooks_hf", "Saved-tensor hooks on HF decoders", cells, notes, device=device)


if __name__ == "__main__":
    main()
