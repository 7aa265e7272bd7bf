"""``torchloom demo``: compile real models with ``loom``, check them against
eager, and time eager, Inductor and loom side by side.

Workloads: a GPT-style block stack and an MLP, each as a training step
(forward + backward) and as inference (batch 8 for the MLP, batch 1 for the
GPT stack). Every compiled result is compared with eager (outputs and every
gradient) before it is timed.

Compile times are measured apart, so that neither backend starts on caches the
other filled: each backend compiles every workload in a fresh process of its own
with its own empty cache directories (Inductor's, Triton's and loom's): the
cold first step; then a second fresh process on the same directories: the warm
first step. The step times come from this process, each backend compiled on its
own (then warm) directories.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
    #: First step (compile + step) of each compiled backend in a fresh process, on
    #: empty caches of its own (cold) and on the caches the cold process filled (warm).
    compile_s: dict[str, float]
    warm_s: dict[str, float]


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
    caches: dict[str, str],
    first_steps: dict[str, dict[str, dict[str, float]]],
) -> DemoResult:
    torch.manual_seed(0)
    base = w.build(size).to(device)
    shape = (w.batch, size.seq, size.width) if w.seq else (w.batch, size.width)
    x = torch.randn(shape, device=device)
    tol = 1e-3 if device.type == "cpu" else 2e-2

    medians: dict[str, float] = {}
    ref_out: torch.Tensor | None = None
    ref_grads: list[torch.Tensor] = []
    worst = 0.0
    for name, wrap in backends.items():
        model = copy.deepcopy(base)
        fn = wrap(model)
        progress(f"{w.name}: {name}")
        with _cache_dirs(caches.get(name)):
            out = _step(fn, x, w.train)  # compiles (warm: on this backend's own caches)
            _sync(device)
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
    cold = {b: first_steps["cold"][b][w.name] for b in first_steps["cold"]}
    warm = {b: first_steps["warm"][b][w.name] for b in first_steps["warm"]}
    return DemoResult(w.name, w.train, worst, worst <= tol, medians, cold, warm)


_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHLOOM_CACHE_DIR")


def _cache_env(root: str) -> dict[str, str]:
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(root, "triton"),
        "TORCHLOOM_CACHE_DIR": os.path.join(root, "loom"),
    }


@contextlib.contextmanager
def _cache_dirs(root: str | None) -> Iterator[None]:
    """One backend's own cache directories, for the compile inside."""
    if root is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in _CACHE_VARS}
    os.environ.update(_cache_env(root))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_steps_child(backend: str, device: str) -> dict[str, float]:
    """In a fresh process: each workload's first step (compile + step), in seconds."""
    dev = torch.device(device)
    size = ModelSize.for_device(dev)
    out = {}
    for w in _workloads(size):
        compat.dynamo_reset()
        torch.manual_seed(0)
        model = w.build(size).to(dev)
        shape = (w.batch, size.seq, size.width) if w.seq else (w.batch, size.width)
        x = torch.randn(shape, device=dev)
        _sync(dev)
        start = time.perf_counter()
        _step(torch.compile(model, backend=backend), x, w.train)
        _sync(dev)
        out[w.name] = time.perf_counter() - start
    return out


def _first_steps(backend: str, device: str, root: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHLOOM_REMOTE_CACHE")}
    env.update(_cache_env(root))
    proc = subprocess.run(
        [sys.executable, "-m", "torchloom._demo", _CHILD, backend, device],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {backend} compile process failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT))
    result: dict[str, float] = json.loads(line.removeprefix(_RESULT))
    return result


_CHILD = "--first-steps"
_RESULT = "FIRST_STEPS "


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
    compiled = [b for b in backends if b != "eager"]
    roots = {b: tempfile.mkdtemp(prefix=f"torchloom-demo-{b}-") for b in compiled}
    try:
        first: dict[str, dict[str, dict[str, float]]] = {"cold": {}, "warm": {}}
        for phase in ("cold", "warm"):
            for b in compiled:
                progress(f"{b}: {phase} compile of every workload in a fresh process")
                first[phase][b] = _first_steps(b, dev.type, roots[b])
        results = []
        for w in _workloads(size):
            compat.dynamo_reset()
            results.append(_run_one(w, size, dev, iters, backends, progress, roots, first))
        return results
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == _CHILD:
    print(_RESULT + json.dumps(_first_steps_child(sys.argv[2], sys.argv[3])), flush=True)
