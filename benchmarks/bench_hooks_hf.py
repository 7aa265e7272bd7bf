"""Saved-tensor hooks on Hugging Face decoders (Llama, GPT-2 from configs): memory, time, compiles.

Training steps (forward with ``labels``, backward) of ``LlamaForCausalLM`` and
``GPT2LMHeadModel`` built from configs with random weights (nothing is
downloaded), fp32. Rows, per model:

- ``no hooks``;
- ``fp8 hooks``: delayed-scaling style fp8 hooks whose closure ``scale`` (a
  Python float) changes at every step; float32 tensors of at least 4096
  elements are stored as ``float8_e4m3fn`` (``(t * scale)`` clamped to the fp8
  range), smaller ones and integer tensors as they are;
- ``fp8 hooks + ckpt``: the same with ``gradient_checkpointing_enable()``
  (non-reentrant), what LLM training combines;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu()`` entered anew each step.

Columns (backends): ``eager``, ``inductor`` (hooks run on the compiled
function's saved tensors after its forward) and ``loom`` (hooks placed in the
graph). For each: ``peak_mib`` (CUDA: the peak allocated during one warm step
above what was allocated before it; none on CPU), ``step_ms`` (median of the
timed steps), ``compiles`` (graphs Dynamo handed to the backend over the first
10 steps, each with its own scale; recompiles count), ``placed`` (loom: graphs with the hooks placed /
graphs compiled) and ``grad_rel_err`` (the first step's gradients against
eager with the same hooks; lossy hooks differ where the compiled partition saves
other tensors than eager). ``peak_vs_eager`` and ``peak_vs_inductor`` compare a
row's peak with the same row under eager and Inductor.

    python benchmarks/bench_hooks_hf.py --device cuda              # about 3 minutes on an H100
    python benchmarks/bench_hooks_hf.py --device cpu --quick --no-append   # smoke run
"""

from __future__ import annotations

import contextlib
import os
import sys
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
        self.scale = 2.0 ** (step % 4)  # the step's scale: a new float every step
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
) -> dict[str, Any]:
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
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    for _ in range(WARM_STEPS - 1):
        step()
    compiles = graphs_compiled() - before
    peak = peak_memory(step, device)
    timing = time_fn(step, warmup=0, iters=iters, device=device)
    cell: dict[str, Any] = {
        "model": model_name,
        "row": row,
        "backend": backend,
        "peak_mib": None if peak is None else peak / MIB,
        "step_ms": timing.median_ms,
        "compiles": compiles if backend != "eager" else None,
        "_grads": grads,
    }
    if backend == "loom":
        report = torchloom.report()
        placed = [g for g in report if any(e.kind == "placed" for e in g.entries)]
        cell["placed"] = f"{len(placed)}/{len(report)}" if row != "no hooks" else None
    torch._dynamo.reset()
    return cell


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Relative L2 error of the first step's gradients against eager's (same hooks)."""
    num = sum(float((a.double() - b.double()).norm() ** 2) for a, b in zip(got, want, strict=True))
    den = sum(float(b.double().norm() ** 2) for b in want)
    return (num / max(den, 1e-30)) ** 0.5


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
        ),
    )
    device = args.device
    cuda = device == "cuda"
    if cuda and not args.quick:
        # NOTE: 2 layers keep the ~14 cold compiles (two models, four rows) near 3 minutes.
        size = {"vocab": 8192, "hidden": 1024, "layers": 2, "heads": 16, "seq": 1024, "batch": 4}
    else:
        size = {"vocab": 128, "hidden": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 2}
    backends = (args.backends or ("eager,inductor,loom" if cuda else "eager,loom")).split(",")
    rows_wanted = [r for r in args.rows.split(",") if r]
    iters = args.iters or (3 if args.quick else 10)
    cells: list[dict[str, Any]] = []
    for model_name in args.models.split(","):
        for row in rows_wanted:
            for backend in backends:
                cell = run_cell(model_name, row, backend, size, device, iters)
                cells.append(cell)
                print(format_table([{k: v for k, v in cell.items() if k != "_grads"}]), flush=True)
    for cell in cells:
        same = [c for c in cells if (c["model"], c["row"]) == (cell["model"], cell["row"])]
        ref = {c["backend"]: c for c in same}
        eager, inductor = ref.get("eager"), ref.get("inductor")
        cell["peak_vs_eager"] = ratio(cell["peak_mib"], eager and eager["peak_mib"])
        cell["peak_vs_inductor"] = ratio(cell["peak_mib"], inductor and inductor["peak_mib"])
        cell["grad_rel_err"] = (
            None if eager is None or cell is eager else rel_err(cell["_grads"], eager["_grads"])
        )
    for cell in cells:
        del cell["_grads"]
    print(format_table(cells))
    notes = (
        f"HF decoders from configs, fp32: hidden {size['hidden']}, {size['layers']} layers, "
        f"{size['heads']} heads, vocab {size['vocab']}, batch {size['batch']} x seq "
        f"{size['seq']}; one step = forward with labels + backward. compiles: graphs "
        f"compiled over {WARM_STEPS} steps whose fp8 scale changes every step; peak: one "
        "warm step above what was allocated before it; placed: loom graphs with the hooks "
        "placed / graphs compiled."
    )
    if not args.no_append:
        append_results("hooks_hf", "Saved-tensor hooks on HF decoders", cells, notes, device=device)


if __name__ == "__main__":
    main()
