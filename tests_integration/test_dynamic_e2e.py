"""Dynamic shapes end to end: where ``aot_eager`` compiles a graph, loom
compiles it too, with the same number of Dynamo frames, no fallback, and the
outputs and gradients of eager. That holds for ``dynamic=True``,
``torch._dynamo.mark_dynamic`` and automatic dynamic shapes, with saved-tensor
hooks in the graph, with unbacked sizes flowing into a hook, and through the
cache across processes. Dynamo's control-flow exceptions (restart analysis)
raised inside loom's pipeline reach Dynamo and are never a fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torchloom

EAGER = {"codegen": "eager", "strict": True}
SIZES = (2, 3, 5, 7)


def _block() -> torch.nn.Module:
    # LayerNorm's eps is a float the graph reads: under dynamic=True Dynamo first
    # traces it as a symbolic float and restarts analysis from AOTAutograd.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )


def _pack_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def _unpack_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def _hooks() -> AbstractContextManager[Any]:
    return torch.autograd.graph.saved_tensors_hooks(_pack_bf16, _unpack_bf16)


def _loom(options: dict[str, Any]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return torchloom.loom_backend(gm, example_inputs, options=options)

    return backend


def _train(
    backend: Any,
    dynamic: bool | None,
    *,
    mark: bool = False,
    hooks: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """Frames Dynamo compiled, outputs per step, gradients after all steps."""
    torch._dynamo.reset()
    model = _block()
    counter = CompileCounterWithBackend(backend) if backend is not None else None
    run = model if counter is None else torch.compile(model, backend=counter, dynamic=dynamic)
    outs = []
    for n in SIZES:
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
        if mark:
            torch._dynamo.mark_dynamic(x, 0)
        with hooks():
            y = run(x)
        y.pow(2).sum().backward()
        outs.append(y.detach())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return (0 if counter is None else counter.frame_count), outs, grads


@pytest.mark.parametrize(
    ("dynamic", "mark"),
    [(True, False), (None, True), (None, False)],
    ids=["dynamic=True", "mark_dynamic", "automatic"],
)
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "saved-tensor-hooks"])
def test_dynamic_block_compiles_where_aot_eager_does_and_matches_eager(
    dynamic: bool | None, mark: bool, hooked: bool
) -> None:
    hooks = _hooks if hooked else nullcontext
    _, want_out, want_grads = _train(None, None, hooks=hooks)
    aot_frames, _, _ = _train("aot_eager", dynamic, mark=mark, hooks=hooks)
    torchloom.reset()
    # strict: any refusal would raise instead of falling back
    frames, out, grads = _train(_loom(EAGER), dynamic, mark=mark, hooks=hooks)
    assert frames == aot_frames
    report = torchloom.report()
    assert [r.fallback for r in report] == [None] * len(report)
    compiled = [r for r in report if not any(e.area == "pipeline" for e in r.entries)]
    # one graph serves every size once it is dynamic (automatic: after one recompile)
    assert len(compiled) == (2 if dynamic is None and not mark else 1)
    tol = {"rtol": 2e-2, "atol": 2e-2} if hooked else {}
    for a, b in zip(out, want_out, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if hooked:
        placed = [e for r in compiled for e in r.entries if (e.area, e.kind) == ("hooks", "placed")]
        assert len(placed) == len(compiled)


def test_restart_analysis_reaches_dynamo_and_is_recorded_not_a_fallback() -> None:
    _train(_loom({"codegen": "eager"}), True)
    report = torchloom.report()
    restarts = [e for r in report for e in r.entries if (e.area, e.kind) == ("pipeline", "restart")]
    assert restarts and "TensorifyScalarRestartAnalysis" in restarts[0].message
    assert all(r.fallback is None for r in report)
    assert "fallback" not in report.format()


@pytest.fixture
def _unbacked() -> Iterator[None]:
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        yield


def _masked(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x[x > 0]  # a size with no hint: an unbacked symbol
    n = (x > 0).sum().item()  # an unbacked int
    return (y * w).sin().sum() + n, y.new_ones(n).sum()


@pytest.mark.usefixtures("_unbacked")
def test_unbacked_sizes_flow_into_the_saved_tensor_hooks_graph() -> None:
    def run(backend: Any) -> tuple[int, list[Any]]:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(_masked, backend=counter)
        seen = []
        for seed in range(3):
            x = torch.randn(32, generator=torch.Generator().manual_seed(seed))
            w = torch.tensor(2.0, requires_grad=True)
            with _hooks():
                a, b = compiled(x, w)
            a.backward()
            seen.append((a.detach(), b, w.grad))
        return counter.frame_count, seen

    aot_frames, want = run("aot_eager")
    torchloom.reset()
    frames, got = run(_loom(EAGER))
    assert frames == aot_frames == 1
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    (record,) = torchloom.report()
    (placed,) = [e for e in record.entries if (e.area, e.kind) == ("hooks", "placed")]
    assert "2 saved tensor(s)" in placed.message  # both saved tensors have size u0
    backward = dict(record.graphs)["backward"]
    assert "sym_size" in backward or "u0" in backward


_CHILD = r"""
import json, sys, torch, torchloom
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU())
compiled = torch.compile(model, backend="loom", dynamic=True, options={"codegen": "eager"})
outs = []
for n in (2, 3, 5):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    y = compiled(x)
    y.sum().backward()
    outs.append(y.detach().double().flatten().tolist())
rep = torchloom.report()
print("RESULT " + json.dumps({
    "cache": [e.kind for e in rep.entries("cache")],
    "fallbacks": [g.fallback for g in rep if g.fallback],
    "stages": sorted({s.name for g in rep for s in g.stages}),
    "out": outs,
    "grads": [p.grad.double().flatten().tolist() for p in model.parameters()],
}))
"""


def _child(tmp: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCHLOOM_CACHE_DIR": str(tmp / "loom"),
        "PYTHONHASHSEED": "random",
    }
    env.pop("TORCHLOOM_REMOTE_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_dynamic_graph_hits_the_cache_in_a_second_process(tmp_path: Path) -> None:
    cold = _child(tmp_path)
    warm = _child(tmp_path)
    assert cold["fallbacks"] == warm["fallbacks"] == []
    assert cold["cache"] == ["miss", "stored"]
    assert warm["cache"] == ["hit"]
    assert "partition" in cold["stages"] and "partition" not in warm["stages"]
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]


# --- GPU: CUDA graphs record once per concrete shape under dynamic=True ---------------------


@pytest.mark.gpu
def test_dynamic_training_with_cudagraphs_records_per_shape_within_the_budget() -> None:
    from torchloom import cudagraph_stats

    first = len(cudagraph_stats())
    model = _block().cuda()
    ref = _block().cuda()
    options = {"cudagraphs": True, "cudagraph_max_shapes": 2, "strict": True}
    compiled = torch.compile(model, backend="loom", dynamic=True, options=options)
    for n in (4, 6, 4, 6, 9, 4):
        x = torch.randn(n, 16, device="cuda")
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-4, atol=1e-4)
        compiled(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)
    report = torchloom.report()
    assert all(r.fallback is None for r in report)
    runtimes = cudagraph_stats()[first:]
    assert runtimes
    shapes = [s.shapes for rt in runtimes for s in rt.segments if s.captured]
    assert shapes and max(shapes) == 2  # 4 and 6 recorded; 9 ran uncaptured
