"""Whole training steps as CUDA graphs: ``torchloom.capture_step`` against a raw capture.

Side by side in one process, per workload (every step: ``zero_grad``, forward,
loss, ``backward()``, ``AdamW(capturable=True).step()``; the one-kernel step is
``x * 2 + 1`` alone):

- ``eager``: the step as written;
- ``raw-graph``: the same eager step captured by hand in one
  ``torch.cuda.CUDAGraph`` (side-stream warm-up, static input copied in per
  call, ``graph.replay()``): the floor any whole-step runtime can reach;
- ``capture-step``: ``torchloom.capture_step(step)`` (guards, input copy,
  replay, gradients and held outputs kept right);
- ``capture-step+loom``: the same over a model compiled with ``backend="loom"``
  (Inductor kernels inside the whole-step graph);
- ``loom-cg``: the model compiled with ``backend="loom",
  options={"cudagraphs": True}`` (per-graph CUDA graphs; the optimizer eager);
- ``reduce-overhead``: the model compiled with ``mode="reduce-overhead"``.

Workloads: the MLP and GPT-stack training steps of ``workloads.py``, a Hugging
Face Llama training step built from a config (``bench_hf.build_llama``,
nothing downloaded) and a one-kernel step. Reported: median step times (CUDA
events), ratios to ``raw-graph`` and ``eager``, the peak memory each variant
allocated from before it was built (model copy, optimizer state, pools), the
largest loss difference from eager over the first calls, and capture_step's
state. Targets (issue 15): ``capture-step`` within 1.10x of ``raw-graph`` on the
training steps and 1.5x on the one-kernel step.

    python benchmarks/bench_step.py --device cuda
    python benchmarks/bench_step.py --smoke        # CPU: checks that it runs (uncaptured)
    python benchmarks/bench_step.py --micro --no-append   # capture_step's host cost per call
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _harness import append_results, format_table, parse_args, ratio, sync, time_fn
from workloads import size_for, workloads

import torchloom

TRAIN_TARGET_RAW = 1.10
ONE_KERNEL_TARGET_RAW = 1.5
CHECK_CALLS = 6

Run = Callable[[], Any]
#: ``loss_of(model, *args) -> scalar loss``
LossFn = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    """One workload on one device: a model (``None`` for a bare function), its
    arguments and how a step computes the loss."""

    model: nn.Module | None
    args: tuple[torch.Tensor, ...]
    loss_of: LossFn


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str  # "train" or "one_kernel"
    build: Callable[[torch.device, bool], Setup]


def _mean_square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _foundation(name: str) -> Case:
    (w,) = [w for w in workloads() if w.name == name]

    def build(device: torch.device, quick: bool) -> Setup:
        model, x = w.build(size_for(device, quick), device)
        return Setup(model, (x,), _mean_square)

    return Case(name, "train", build)


def _hf_llama(device: torch.device, quick: bool) -> Setup:
    from bench_hf import GPU_SIZE, QUICK_SIZE, build_llama

    size = QUICK_SIZE if quick or device.type == "cpu" else GPU_SIZE
    model = build_llama(size).to(device).train()
    ids = torch.randint(
        0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1)
    )

    def loss_of(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    return Setup(model, (ids.to(device),), loss_of)


def _one_kernel(device: torch.device, quick: bool) -> Setup:
    return Setup(None, (torch.randn(1024, device=device),), lambda f, x: f(x))


CASES = (
    _foundation("mlp_train"),
    _foundation("gpt_train"),
    Case("hf_llama_train", "train", _hf_llama),
    Case("one_kernel", "one_kernel", _one_kernel),
)


def _kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def make_step(
    setup: Setup, wrap: Callable[[Any], Any]
) -> tuple[Callable[..., Any], nn.Module | None]:
    """A fresh copy of the workload's step, the model wrapped by ``wrap`` (a compile)."""
    if setup.model is None:
        fn = wrap(_kernel)

        def kernel_step(x: torch.Tensor) -> torch.Tensor:
            return setup.loss_of(fn, x)

        return kernel_step, None
    model = copy.deepcopy(setup.model)
    on_cuda = next(model.parameters()).device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=on_cuda)
    forward = wrap(model)
    loss_of = setup.loss_of

    def train_step(*args: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward, *args)
        loss.backward()
        opt.step()
        return loss.detach()

    return train_step, model


def _plain(m: Any) -> Any:
    return m


def _raw_graph(setup: Setup) -> Run:
    """The eager step captured by hand, as PyTorch's whole-network recipe does."""
    step, _ = make_step(setup, _plain)
    static = [a.clone() for a in setup.args]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    args = list(setup.args)

    def run() -> torch.Tensor:
        for s, a in zip(static, args, strict=True):
            s.copy_(a)
        graph.replay()
        return out

    return run


def variants(setup: Setup, device: torch.device, smoke: bool) -> dict[str, Callable[[], Run]]:
    """Builders of each variant's per-call function (built one at a time)."""

    def called(step: Callable[..., Any]) -> Run:
        args = setup.args
        return lambda: step(*args)

    def captured(wrap: Callable[[Any], Any]) -> Run:
        step, model = make_step(setup, wrap)
        return called(torchloom.capture_step(step, track=[model] if model is not None else []))

    out: dict[str, Callable[[], Run]] = {
        "eager": lambda: called(make_step(setup, _plain)[0]),
        "capture-step": lambda: captured(_plain),
    }
    if smoke or device.type != "cuda":
        return out

    def ro() -> Run:
        step, _ = make_step(setup, lambda m: torch.compile(m, mode="reduce-overhead"))
        args = setup.args

        def run() -> Any:
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
            return step(*args)

        return run

    return {
        "eager": out["eager"],
        "raw-graph": lambda: _raw_graph(setup),
        "capture-step": out["capture-step"],
        "capture-step+loom": lambda: captured(lambda m: torch.compile(m, backend="loom")),
        "loom-cg": lambda: called(
            make_step(
                setup, lambda m: torch.compile(m, backend="loom", options={"cudagraphs": True})
            )[0]
        ),
        "reduce-overhead": ro,
    }


class _NoopDevice:
    """A capture that runs the step once and a replay that does nothing: what is
    left of a call is capture_step's own host work (guards, copies, gradients)."""

    type = "cpu"

    def available(self) -> bool:
        return True

    def warm_up(self, fn: Callable[[], Any], syncs: list[Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        return None, fn()

    def replayer(self, graph: Any) -> Callable[[], object]:
        return lambda: None


def micro(calls: int = 20000, rounds: int = 5) -> list[dict[str, Any]]:
    """Microseconds per call of capture_step's host path with a replay that does
    nothing, on the MLP and GPT-stack training steps (CPU, SGD with momentum)."""
    import time

    from torchloom._capture_step import CapturedStep

    rows = []
    for name in ("mlp_train", "gpt_train"):
        (w,) = [w for w in workloads() if w.name == name]
        model, x = w.build(size_for(torch.device("cpu"), True), torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def train_step(x: torch.Tensor, model: nn.Module = model, opt: Any = opt) -> torch.Tensor:
            opt.zero_grad()
            loss = _mean_square(model, x)
            loss.backward()
            opt.step()
            return loss.detach()

        step = CapturedStep(
            train_step, torchloom.resolve_options(env={}), [model, opt], device=_NoopDevice()
        )
        for _ in range(5):
            step(x)
        assert step.stats().replays == 2, step.stats().format()
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls // rounds):
                step(x)
            samples.append((time.perf_counter() - t0) / (calls // rounds) * 1e6)
        rows.append(
            {
                "case": name,
                "params": len(list(model.parameters())),
                "median_us": sorted(samples)[len(samples) // 2],
                "min_us": min(samples),
            }
        )
    return rows


def _capture_state() -> str | None:
    entries = torchloom.report().entries("capture_step")
    if not entries:
        return None
    return "; ".join(f"{e.kind}: {e.message}" for e in entries)[:300]


def measure(
    case: Case, device: torch.device, quick: bool, iters: int, smoke: bool
) -> list[dict[str, Any]]:
    setup = case.build(device, quick)
    reference: list[float] = []
    rows: list[dict[str, Any]] = []
    warmup = 2 if smoke else 10
    for name, build in variants(setup, device, smoke).items():
        torchloom.reset()
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row: dict[str, Any] = {"workload": case.name, "variant": name}
        try:
            run = build()
            losses = [float(run().float().sum()) for _ in range(CHECK_CALLS)]
            if name == "eager":
                reference = losses
            if name != "raw-graph" and reference:
                row["max_loss_diff"] = max(
                    abs(a - b) for a, b in zip(losses, reference, strict=True)
                )
            row.update(time_fn(run, warmup=warmup, iters=iters, device=device).as_dict())
            if device.type == "cuda":
                sync(device)
                row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            if name.startswith("capture-step"):
                row["capture"] = _capture_state()
            del run
        except Exception as exc:  # a failing variant is a row, not a lost run
            row["error"] = repr(exc)[:300]
        print(f"  {case.name:<15} {name:<18} {row.get('median_ms', row.get('error'))}", flush=True)
        rows.append(row)
    torch._dynamo.reset()
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["vs_raw"] = ratio(r.get("median_ms"), by.get("raw-graph", {}).get("median_ms"))
        r["vs_eager"] = ratio(r.get("median_ms"), by.get("eager", {}).get("median_ms"))
        r["peak_vs_raw"] = ratio(r.get("peak_mib"), by.get("raw-graph", {}).get("peak_mib"))
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    kinds = {c.name: c.kind for c in CASES}
    lines = []
    for r in rows:
        if r["variant"] != "capture-step":
            continue
        target = ONE_KERNEL_TARGET_RAW if kinds[r["workload"]] == "one_kernel" else TRAIN_TARGET_RAW
        raw = r.get("vs_raw")
        verdict = "—" if raw is None else ("met" if raw <= target else "NOT met")
        lines.append(
            f"{r['workload']}: capture-step {_x(raw)} of raw replay (target <= {target}x: {verdict}), "
            f"{_x(r.get('vs_eager'))} of eager, peak memory {_x(r.get('peak_vs_raw'))} of raw"
        )
    return lines


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=None, help="comma-separated workload names")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU check that it runs: tiny sizes, 2 iterations"
    )
    parser.add_argument(
        "--micro",
        action="store_true",
        help="capture_step's host cost per call, with a replay that does nothing (CPU)",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "", argv, _configure)
    if args.micro:
        rows = micro()
        print(format_table(rows))
        if not args.no_append:
            notes = "Microseconds per call of capture_step with a replay that does nothing."
            path = append_results("step", "capture_step per-call host path", rows, notes)
            print(f"appended to {path}")
        return 0
    if args.smoke:
        args.device, args.quick, args.iters, args.no_append = "cpu", True, 2, True
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    wanted = set(args.workloads.split(",")) if args.workloads else {c.name for c in CASES}
    print(f"whole-step benchmark on {device}, {args.iters} iterations", flush=True)
    rows: list[dict[str, Any]] = []
    for case in CASES:
        if case.name in wanted:
            rows += measure(case, device, args.quick, args.iters, args.smoke)
    lines = verdicts(rows)
    print()
    print(format_table(rows))
    print()
    print("\n".join(lines))
    failed = [r for r in rows if "error" in r]
    if args.smoke:
        return 1 if failed else 0
    if not args.no_append:
        notes = (
            "Median step times (CUDA events per call). raw-graph: the eager step captured by hand "
            "in one torch.cuda.CUDAGraph, input copied in, replayed. peak_mib: bytes allocated "
            "at peak since the variant was built (model copy, optimizer state, graph pools). "
            f"{'Quick run. ' if args.quick else ''}\n\n" + "\n".join(f"- {line}" for line in lines)
        )
        path = append_results(
            "step",
            f"Whole-step CUDA graphs: capture_step / raw replay / loom-cg / reduce-overhead on {device}",
            rows,
            notes,
            device=device,
        )
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
