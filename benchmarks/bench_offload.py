"""Activation offload: step time, memory and bytes moved, against the PCIe bound.

A Hugging Face ``LlamaForCausalLM`` built from a config (random weights, nothing
downloaded): 8 layers, hidden 1024, 16 heads / 4 KV heads, vocab 32000, SDPA.
One step is a forward with ``labels`` under bf16 autocast, then backward; batch
4 x 1024 tokens. Rows (saved-tensor hooks entered anew each step):

- ``no hooks``;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
- ``stream pair``: torchtune's ``OffloadActivations`` reduced to its core (tensors of
  at least 64 Ki elements copied on a side stream into a pinned buffer, the unpack
  waits for that stream and copies back ``non_blocking``);
- ``cpu()``: ``pack = t.cpu()``, ``unpack = t.to(device)``;
- ``fp8 + offload``: float tensors of at least 64 Ki elements cast to
  ``float8_e4m3fn`` and moved to the host (lossy; not an offload pair, so loom keeps
  the hooks' own copies).

Backends: ``eager``, ``inductor`` (hooks run on the compiled function's saved
tensors) and ``loom`` (hooks placed in the graph, offload pairs lowered). Columns:
``step_ms`` (median over interleaved rounds of ``--steps`` steps, each round's median
in ``spread``), ``peak_mib`` and ``reserved_mib`` (one warm step above what was
allocated before it; the allocator's peak reserved), ``moved_mib`` (bytes copied to
the host per step: loom's from ``loom_offload``'s counters, the others' from a
counting pair), the pinned bandwidth measured in the same run, ``bound_ms`` (the
moved bytes at that bandwidth, each way) and ``x_bound``, and ``grad_err`` (largest
per-parameter max-abs difference relative to the parameter gradient's max, against
eager with the same hooks; ``no hooks`` gives the compiled graph's own noise).

    python benchmarks/bench_offload.py --device cuda             # a few minutes on an H200
    python benchmarks/bench_offload.py --device cpu --quick --no-append   # smoke run (CI)
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, sync

import torchloom

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MIB = 2**20
ROWS = ("no hooks", "save_on_cpu", "stream pair", "cpu()", "fp8 + offload")
BACKENDS = ("eager", "inductor", "loom")
MIN_NUMEL = 65536


# -- hooks ------------------------------------------------------------------------------------


def stream_pair(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torchtune's OffloadActivations reduced to its core (issue 45)."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else torch.cpu.Stream()
    cuda = device.type == "cuda"

    def pack(t: torch.Tensor) -> Any:
        if t.numel() < MIN_NUMEL:
            return (t.device, t)
        cpu = torch.empty(t.size(), dtype=t.dtype, pin_memory=cuda)
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                cpu.copy_(t, non_blocking=True)
            t.record_stream(side)
        else:
            cpu.copy_(t)
        return (t.device, cpu)

    def unpack(packed: Any) -> torch.Tensor:
        device, cpu = packed
        if cuda:
            torch.cuda.current_stream().wait_stream(side)
        return cpu.to(device, non_blocking=True)

    return pack, unpack


def cpu_pair() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def pack(t: torch.Tensor) -> Any:
        return (t.device, t.cpu())

    def unpack(packed: Any) -> torch.Tensor:
        device, cpu = packed
        return cpu.to(device)

    return pack, unpack


def fp8_offload_pair() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def pack(t: torch.Tensor) -> Any:
        if t.is_floating_point() and t.numel() >= MIN_NUMEL:
            q = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            return (t.device, t.dtype, q.cpu())
        return (t.device, t.dtype, t)

    def unpack(packed: Any) -> torch.Tensor:
        device, dtype, q = packed
        return q.to(device).to(dtype)

    return pack, unpack


def hooks_for(
    row: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    if row == "no hooks":
        return contextlib.nullcontext
    if row == "save_on_cpu":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    pair = {
        "stream pair": stream_pair,
        "cpu()": lambda d: cpu_pair(),
        "fp8 + offload": lambda d: fp8_offload_pair(),
    }[row](device)
    return lambda: torch.autograd.graph.saved_tensors_hooks(*pair)


def counting_pair(moved: list[int], row: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """What eager moves to the host with ``row``'s hooks, counted (nothing moved)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        if row == "save_on_cpu" or row == "cpu()" or t.numel() >= MIN_NUMEL:
            size = t.element_size() if row != "fp8 + offload" or not t.is_floating_point() else 1
            moved[0] += t.numel() * size
        return t

    return pack, lambda t: t


# -- model ------------------------------------------------------------------------------------


def build(size: dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["hidden"] * 11 // 4,
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def make_step(
    model: Any, ids: torch.Tensor, hooks: Callable[[], contextlib.AbstractContextManager[Any]]
) -> Callable[[], None]:
    dtype = torch.bfloat16
    device_type = ids.device.type

    def step() -> None:
        with hooks(), torch.autocast(device_type, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return step


# -- measurements -----------------------------------------------------------------------------


def pinned_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of pinned copies each way alone, and each way while the other runs."""
    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / 5

    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))

    def both() -> None:
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    duplex = timed(both)
    return {
        "d2h_gbs": nbytes / d2h / 1e9,
        "h2d_gbs": nbytes / h2d / 1e9,
        "duplex_gbs": nbytes / duplex / 1e9,
    }


def step_memory(
    step: Callable[[], None], device: torch.device
) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    sync(device)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / MIB
    reserved = torch.cuda.max_memory_reserved(device) / MIB
    return peak, reserved


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.detach().float().clone() if p.grad is not None else torch.zeros(())
        for p in model.parameters()
    ]


def grad_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = float(w.abs().max()) if w.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((g - w).abs().max()) / scale)
    return worst


@contextlib.contextmanager
def cell_error(row: dict[str, Any]) -> Iterator[None]:
    try:
        yield
    except Exception as err:  # a cell that fails is a row with its error; the rest runs
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def main() -> None:
    def configure(parser: Any) -> None:
        parser.add_argument("--rows", default=",".join(ROWS))
        parser.add_argument("--backends", default=",".join(BACKENDS))
        parser.add_argument("--rounds", type=int, default=None)
        parser.add_argument("--steps", type=int, default=None)
        parser.add_argument("--layers", type=int, default=None)
        parser.add_argument(
            "--loom-variants",
            default="",
            help="extra loom columns with other offload options, ';'-separated, each "
            "'min=MiB,window=MiB,prefetch=MiB,layers=N' (e.g. 'window=128,prefetch=256,layers=1')",
        )

    args = parse_args(__doc__ or "", configure=configure)
    device = torch.device(args.device)
    if args.quick:
        size = {
            "hidden": 64,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "vocab": 256,
            "seq": 64,
            "batch": 2,
        }
        rounds, steps = args.rounds or 2, args.steps or 2
    else:
        size = {
            "hidden": 1024,
            "layers": 8,
            "heads": 16,
            "kv_heads": 4,
            "vocab": 32000,
            "seq": 1024,
            "batch": 4,
        }
        rounds, steps = args.rounds or 7, args.steps or 4
    if args.layers:
        size["layers"] = args.layers
    rows_wanted = [r for r in args.rows.split(",") if r]
    backends = [b for b in args.backends.split(",") if b]
    variants = _variants(args.loom_variants)
    backends += list(variants)
    loom_options = {"codegen": "eager"} if device.type == "cpu" else {}
    inductor_backend = "aot_eager" if device.type == "cpu" else "inductor"
    model = build(size, device)
    torch.manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    bandwidth = pinned_bandwidth(device, 1 << 30)

    cells: dict[tuple[str, str], dict[str, Any]] = {}
    steps_of: dict[tuple[str, str], Callable[[], None]] = {}
    reference: dict[str, list[torch.Tensor]] = {}
    for row in rows_wanted:
        hooks = hooks_for(row, device)
        for backend in backends:
            cell: dict[str, Any] = {"row": row, "backend": backend}
            cells[(row, backend)] = cell
            with cell_error(cell):
                torch._dynamo.reset()
                if backend == "eager":
                    runner: Any = model
                elif backend == "inductor":
                    runner = torch.compile(model, backend=inductor_backend)
                else:
                    extra = variants.get(backend, {})
                    runner = torch.compile(model, backend="loom", options={**loom_options, **extra})
                step = make_step(runner, ids, hooks)
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                step()
                sync(device)
                cell["first_s"] = round(time.perf_counter() - t0, 2)
                got = grads(model)
                if backend == "eager":
                    reference[row] = got
                elif row in reference:
                    cell["grad_err"] = grad_err(got, reference[row])
                for _ in range(2):
                    model.zero_grad(set_to_none=True)
                    step()
                model.zero_grad(set_to_none=True)
                moved_before = _loom_moved()
                peak, reserved = step_memory(step, device)
                cell["peak_mib"], cell["reserved_mib"] = peak, reserved
                if backend.startswith("loom"):
                    cell["moved_mib"] = (_loom_moved() - moved_before) / MIB
                steps_of[(row, backend)] = step
                if backend.startswith("loom"):
                    cell["offload"] = _offload_summary()
        if "eager" in backends and row != "no hooks":
            moved = [0]
            counting = torch.autograd.graph.saved_tensors_hooks(*counting_pair(moved, row))
            with counting, torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            for backend in backends:
                if not backend.startswith("loom") or "moved_mib" not in cells[(row, backend)]:
                    cells[(row, backend)]["moved_mib"] = moved[0] / MIB

    samples: dict[tuple[str, str], list[float]] = {k: [] for k in steps_of}
    round_medians: dict[tuple[str, str], list[float]] = {k: [] for k in steps_of}
    for _ in range(rounds):
        for key, step in steps_of.items():
            times = []
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            samples[key] += times
            round_medians[key].append(statistics.median(times))
    for key, cell in cells.items():
        if samples.get(key):
            cell["step_ms"] = statistics.median(samples[key])
            cell["spread"] = f"{min(round_medians[key]):.1f}-{max(round_medians[key]):.1f}"
        moved = cell.get("moved_mib")
        if bandwidth and moved:
            bound = moved * MIB / (bandwidth["d2h_gbs"] * 1e9) + moved * MIB / (
                bandwidth["h2d_gbs"] * 1e9
            )
            cell["bound_ms"] = bound * 1e3
            if "step_ms" in cell:
                cell["x_bound"] = cell["step_ms"] / cell["bound_ms"]
        eager = cells.get((key[0], "eager"), {})
        if "step_ms" in cell and "step_ms" in eager:
            cell["vs_eager"] = cell["step_ms"] / eager["step_ms"]
        if cell.get("peak_mib") is not None and eager.get("peak_mib"):
            cell["peak_vs_eager"] = cell["peak_mib"] / eager["peak_mib"]
    rows = list(cells.values())
    notes = (
        f"Llama {size['layers']} layers, hidden {size['hidden']}, batch {size['batch']} x {size['seq']}, "
        f"bf16 autocast; {rounds} interleaved rounds of {steps} steps. Pinned bandwidth (GB/s): "
        + (", ".join(f"{k} {v:.1f}" for k, v in bandwidth.items()) or "n/a (CPU)")
    )
    print(notes)
    print(format_table(rows))
    if not args.no_append:
        append_results("offload", "Activation offload on a Llama", rows, notes, device=device)


def _variants(spec: str) -> dict[str, dict[str, int]]:
    names = {
        "min": "offload_min_bytes",
        "window": "offload_window_bytes",
        "prefetch": "offload_prefetch_bytes",
        "layers": "offload_prefetch_layers",
    }
    out: dict[str, dict[str, int]] = {}
    for item in filter(None, (v.strip() for v in spec.split(";"))):
        opts: dict[str, int] = {}
        for part in item.split(","):
            key, value = part.split("=")
            opts[names[key]] = int(value) if key == "layers" else int(value) * MIB
        out[f"loom[{item}]"] = opts
    return out


def _loom_moved() -> int:
    import loom_offload

    return sum(
        loom_offload.transfers_for(torch.device(d)).stats().offloaded_bytes
        for d in loom_offload.pool_stats()
    )


def _offload_summary() -> str:
    report = torchloom.report()
    text = getattr(report, "format", lambda: str(report))()
    lines = [line.strip() for line in str(text).splitlines() if "[offload]" in line]
    return lines[-1][:400] if lines else ""


if __name__ == "__main__":
    main()
