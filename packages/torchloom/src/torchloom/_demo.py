"""``torchloom demo``: compile real models with ``loom``, check them against
eager, and time eager, Inductor and loom side by side.

Workloads: a GPT-style block stack and an MLP, each as a training step
(forward + backward) and as inference (batch 8 for the MLP, batch 1 for the
GPT stack). Every compiled result is compared with eager (outputs and every
gradient) before it is timed.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchloom import _torch_compat as compat
from torchloom._models import MLP, GPTStack, ModelSize

__all__ = ["DemoResult", "run_demo"]


@dataclasses.dataclass(frozen=True, slots=True)
class DemoResult:
    workload: str
    train: bool
    max_abs_diff: float
    ok: bool
    median_ms: dict[str, float]
    compile_s: dict[str, float]


@dataclasses.dataclass(frozen=True, slots=True)
class _Workload:
    name: str
    build: Callable[[ModelSize], nn.Module]
    train: bool
    batch: int
    seq: bool  # input is (batch, seq, width) rather than (batch, width)


def _workloads(size: ModelSize) -> list[_Workload]:
    return [
        _Workload("MLP train step", lambda s: MLP(s.width, s.depth * 2), True, size.batch, False),
        _Workload(
            "GPT train step", lambda s: GPTStack(s.width, s.depth, s.heads), True, size.batch, True
        ),
        _Workload("MLP inference (batch 8)", lambda s: MLP(s.width, s.depth * 2), False, 8, False),
        _Workload(
            "GPT inference (batch 1)", lambda s: GPTStack(s.width, s.depth, s.heads), False, 1, True
        ),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: Callable[..., torch.Tensor], x: torch.Tensor, train: bool) -> torch.Tensor:
    if train:
        out = model(x)
        torch.autograd.backward(out.float().pow(2).mean())
        return out
    with torch.inference_mode():
        return model(x)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _run_one(
    w: _Workload,
    size: ModelSize,
    device: torch.device,
    iters: int,
    backends: dict[str, Callable[[nn.Module], Callable[..., torch.Tensor]]],
    progress: Callable[[str], None],
) -> DemoResult:
    torch.manual_seed(0)
    base = w.build(size).to(device)
    shape = (w.batch, size.seq, size.width) if w.seq else (w.batch, size.width)
    x = torch.randn(shape, device=device)
    tol = 1e-3 if device.type == "cpu" else 2e-2

    medians: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    ref_out: torch.Tensor | None = None
    ref_grads: list[torch.Tensor] = []
    worst = 0.0
    for name, wrap in backends.items():
        model = copy.deepcopy(base)
        fn = wrap(model)
        progress(f"{w.name}: {name} (first call compiles)")
        _sync(device)
        start = time.perf_counter()
        out = _step(fn, x, w.train)
        _sync(device)
        compile_s[name] = time.perf_counter() - start
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if ref_out is None:
            ref_out, ref_grads = out.clone(), grads
        else:
            worst = max(worst, _max_diff(out, ref_out))
            if w.train:
                if len(grads) != len(ref_grads):
                    worst = float("inf")
                for g, r in zip(grads, ref_grads, strict=False):
                    worst = max(worst, _max_diff(g, r) / (1.0 + float(r.abs().max())))
        times = []
        for _ in range(iters):
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            _step(fn, x, w.train)
            _sync(device)
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times) * 1e3
    return DemoResult(w.name, w.train, worst, worst <= tol, medians, compile_s)


def run_demo(
    device: str | None = None,
    iters: int = 10,
    inductor: bool = True,
    progress: Callable[[str], None] = lambda _msg: None,
) -> list[DemoResult]:
    """Run every workload; return one :class:`DemoResult` each."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    size = ModelSize.for_device(dev)
    backends: dict[str, Callable[[nn.Module], Callable[..., Any]]] = {
        "eager": lambda m: m,
        "loom": lambda m: torch.compile(m, backend="loom"),
    }
    if inductor:
        backends["inductor"] = lambda m: torch.compile(m, backend="inductor")
    results = []
    for w in _workloads(size):
        compat.dynamo_reset()
        results.append(_run_one(w, size, dev, iters, backends, progress))
    return results
