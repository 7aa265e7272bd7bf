"""The smoke test CI runs on every torch release between the locked and the newest
one (``nox -s smoke``; docs/releases.md): import, a training step with saved-tensor
hooks placed in the graph and CUDA graphs requested (on CPU they fall back with
a reason), and loom's cache hit in a second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_CHILD = r"""
import json, warnings
warnings.filterwarnings("error", message="torchloom is tested with")  # untested release: fail
import torch, torchloom
from torchloom._models import GPTStack


class Scale(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


hooks = (torch.fx.symbolic_trace(Scale(2.0)), torch.fx.symbolic_trace(Scale(0.5)))
torch.manual_seed(0)
model = GPTStack(32, 1, 4)
x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
compiled = torch.compile(model, backend="loom", options={"codegen": "eager", "cudagraphs": True})
with torch.autograd.graph.saved_tensors_hooks(*hooks):
    out = compiled(x)
out.pow(2).mean().backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
with torch.autograd.graph.saved_tensors_hooks(*hooks):
    ref = model(x)
ref.pow(2).mean().backward()
rep = torchloom.report()
print("RESULT " + json.dumps({
    "torch": str(torch.__version__),
    "cache": [e.kind for e in rep.entries("cache")],
    "hooks": [e.kind for e in rep.entries("hooks")],
    "segments": [dict(e.data) for e in rep.entries("cudagraph") if e.kind == "segment"],
    "fallbacks": [e.message for e in rep.entries() if e.kind == "fallback"],
    "max_diff": max(
        [float((out - ref).detach().abs().max())]
        + [float((g - p.grad).abs().max()) for g, p in zip(grads, model.parameters())]
    ),
    "out": out.detach().double().flatten().tolist(),
    "grads": [g.double().flatten().tolist() for g in grads],
}))
"""


def _run(tmp: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHLOOM_REMOTE_CACHE"}
    env.update(TORCHLOOM_CACHE_DIR=str(tmp / "loom"), PYTHONHASHSEED="random")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_training_step_with_hooks_and_cudagraphs_then_a_cache_hit(tmp_path: Path) -> None:
    cold = _run(tmp_path)
    assert cold["torch"] == str(torch.__version__)
    # The step matches eager under the same hooks; nothing fell back to eager.
    assert cold["max_diff"] < 1e-4 and cold["fallbacks"] == []
    # The hooks were placed inside the compiled graphs.
    assert cold["hooks"] == ["variant", "placed"]
    # CUDA graphs were requested; on CPU every segment runs uncaptured, with its reasons.
    assert cold["segments"] and all(not s["captured"] and s["reasons"] for s in cold["segments"])
    assert cold["cache"] == ["miss", "stored"]

    warm = _run(tmp_path)
    assert warm["cache"] == ["hit"]
    assert warm["hooks"] == cold["hooks"] and warm["segments"] == cold["segments"]
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]
