"""loom's cache across processes: a second process compiling the GPT-stack
training step gets a full hit and exactly the outputs and gradients of the cold
process, with CUDA graphs too (same plans, same captured segments replayed); a
fleet shares entries through Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_redis import RedisServer

_CHILD = r"""
import json, sys, torch, torchloom
from torchloom._models import GPTStack
device, codegen = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = GPTStack(32, 1, 4).to(device)
x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(device)
compiled = torch.compile(model, backend="loom", options={"codegen": codegen})
out = compiled(x)
out.float().pow(2).mean().backward()
rep = torchloom.report()
print("RESULT " + json.dumps({
    "cache": [e.kind for e in rep.entries("cache")],
    "stages": sorted({s.name for g in rep for s in g.stages}),
    "out": out.detach().double().flatten().tolist(),
    "grads": [p.grad.double().flatten().tolist() for p in model.parameters()],
}))
"""


_CACHE_VARS = ("TORCHLOOM_REMOTE_CACHE", "TORCHLOOM_CACHE_KEY", "TORCHLOOM_CACHE_NAMESPACE")


def _run(env: dict[str, str], device: str = "cpu", codegen: str = "eager") -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, device, codegen],
        env={**{k: v for k, v in os.environ.items() if not k.startswith(_CACHE_VARS)}, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def _assert_same_numbers(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    # Bitwise: a hit runs the very code the cold compile generated.
    assert warm["out"] == cold["out"]
    assert warm["grads"] == cold["grads"]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        "TORCHLOOM_CACHE_DIR": str(tmp / "loom"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        "PYTHONHASHSEED": "random",
        **extra,
    }
    return env


def test_second_process_gets_a_full_hit_and_identical_outputs_and_gradients(
    tmp_path: Path,
) -> None:
    cold = _run(_env(tmp_path))
    warm = _run(_env(tmp_path))
    assert cold["cache"] == ["miss", "stored"] and "partition" in cold["stages"]
    assert warm["cache"] == ["hit"]
    assert "partition" not in warm["stages"]
    assert not any(s.startswith("codegen") for s in warm["stages"])
    _assert_same_numbers(cold, warm)


@pytest.mark.inductor
def test_second_process_hits_with_inductor_codegen(tmp_path: Path) -> None:
    cold = _run(_env(tmp_path), codegen="inductor")
    warm = _run(_env(tmp_path), codegen="inductor")
    assert cold["cache"] == ["miss", "stored"] and warm["cache"] == ["hit"]
    _assert_same_numbers(cold, warm)


@pytest.mark.gpu
def test_second_process_hits_on_the_gpu(tmp_path: Path) -> None:
    cold = _run(_env(tmp_path), device="cuda", codegen="inductor")
    warm = _run(_env(tmp_path), device="cuda", codegen="inductor")
    assert cold["cache"] == ["miss", "stored"] and warm["cache"] == ["hit"]
    assert "partition" not in warm["stages"]
    # The same kernels run; a tolerance only guards against run-to-run GPU reduction order.
    import torch

    torch.testing.assert_close(torch.tensor(warm["out"]), torch.tensor(cold["out"]))
    for a, b in zip(warm["grads"], cold["grads"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))


_CUDAGRAPH_CHILD = r"""
import json, sys, torch, torchloom, loom_cudagraph
from torchloom._models import GPTStack
from torchloom import cudagraph_stats
phase, codegen = sys.argv[1], sys.argv[2]
if phase == "warm":
    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not plan")
    loom_cudagraph.plan_graph = refuse
torch.manual_seed(0)
model = GPTStack(32, 1, 4).to("cuda")
compiled = torch.compile(model, backend="loom", options={"codegen": codegen, "cudagraphs": True})
outs = []
for i in range(4):
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)).to("cuda")
    out = compiled(x)
    out.float().pow(2).mean().backward()
    outs.append(out.detach().double().flatten().tolist())
torch.cuda.synchronize()
rep = torchloom.report()
segments = [s for r in cudagraph_stats() for s in r.segments]
print("RESULT " + json.dumps({
    "cache": [e.kind for e in rep.entries("cache")],
    "stages": sorted({s.name for g in rep for s in g.stages}),
    "plan": [[e.kind, e.message, [list(kv) for kv in e.data]] for e in rep.entries("cudagraph")
             if e.kind in ("segment", "skip", "disabled")],
    "skips": {k.value: v for k, v in loom_cudagraph.skip_counts().items()},
    "captured": sum(s.captured for s in segments),
    "replays": sum(s.replays for s in segments),
    "out": outs,
    "grads": [p.grad.double().flatten().tolist() for p in model.parameters()],
}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_second_process_hits_with_cuda_graphs_and_replays_the_captured_segments(
    tmp_path: Path, codegen: str
) -> None:
    runs = []
    for phase in ("cold", "warm"):
        proc = subprocess.run(
            [sys.executable, "-c", _CUDAGRAPH_CHILD, phase, codegen],
            env={**os.environ, **_env(tmp_path)},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        runs.append(json.loads(line.removeprefix("RESULT ")))
    cold, warm = runs
    assert cold["cache"] == ["miss", "stored"] and warm["cache"] == ["hit"]
    assert "partition" not in warm["stages"]  # no AOT tracing, planning or codegen
    assert not any(s.startswith("codegen") for s in warm["stages"])
    assert warm["plan"] == cold["plan"]  # segments, captured or not, why, node counts
    assert warm["skips"] == cold["skips"]
    assert warm["captured"] == cold["captured"] > 0
    assert warm["replays"] == cold["replays"] > 0
    import torch

    torch.testing.assert_close(torch.tensor(warm["out"]), torch.tensor(cold["out"]))
    for a, b in zip(warm["grads"], cold["grads"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def test_a_second_machine_hits_through_redis(tmp_path: Path, redis_url: str) -> None:
    # Two "machines": separate local stores, one shared Redis tier.
    fleet = {
        "TORCHLOOM_REMOTE_CACHE": redis_url,
        "TORCHLOOM_CACHE_KEY": "fleet-key-0123456789abcdef",
    }
    cold = _run(_env(tmp_path / "a", **fleet))
    warm = _run(_env(tmp_path / "b", **fleet))
    assert cold["cache"] == ["miss", "stored"] and warm["cache"] == ["hit"]
    _assert_same_numbers(cold, warm)
