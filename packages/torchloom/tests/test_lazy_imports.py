"""``backend="loom"`` imports only what a graph needs: a plain model compiled with the
default options never loads the hook tracer, the hook operators and placement, the
CUDA-graph planner and runtime, or the resize passes; a graph that needs them loads
them. Each case runs in a fresh interpreter, since a test process has imported
everything long before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

#: What a plain graph must not load (each stands for a family of modules).
HEAVY = (
    "loom_tracer",
    "loom_cells",
    "loom_step",
    "loom_hops._hook_hops",
    "loom_hops._subgraph_hop",
    "loom_hops._grad_hooks",
    "loom_hops._grad_hook_inline",
    "loom_hops._placement",
    "loom_hops._saved_hooks",
    "loom_hops._python_hooks",
    "loom_hops._hook_graphs",
    "loom_cudagraph._plan",
    "loom_cudagraph._segment",
    "loom_cudagraph._runtime",
    "loom_cudagraph._classify",
    "loom_cudagraph._collectives",
    "loom_resize._chains",
    "loom_resize._fills",
    "loom_resize._shrinks",
    "loom_sidefx._builder",
    "loom_sidefx._replay",
)

_PRELUDE = """
import json, sys, torch, torchloom

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

def run(model, backend="loom", **compile_kwargs):
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    x = torch.randn(4, 8, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    expected = model(x)
    assert torch.allclose(out, expected), (out, expected)

def done(**extra):
    loaded = sorted(m for m in sys.modules if m.startswith(("loom_", "torchloom")))
    kinds = [(e.area, e.kind) for g in torchloom.report().graphs for e in g.entries]
    print(json.dumps({"loaded": loaded, "entries": kinds, **extra}))
"""


def _run(script: str, cache: Path) -> dict[str, object]:
    env = {**os.environ, "TORCHLOOM_CACHE_DIR": str(cache)}
    env.pop("TORCHLOOM_REMOTE_CACHE", None)
    code = _PRELUDE + textwrap.dedent(script)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _loaded(result: dict[str, object], prefixes: tuple[str, ...]) -> list[str]:
    loaded = result["loaded"]
    assert isinstance(loaded, list)
    return [m for m in loaded if m.startswith(prefixes)]


def _entries(result: dict[str, object]) -> list[tuple[str, str]]:
    entries = result["entries"]
    assert isinstance(entries, list)
    return [(area, kind) for area, kind in entries]


def test_a_plain_model_loads_none_of_the_machinery_it_does_not_use(tmp_path: Path) -> None:
    script = """
    run(mlp(), options={"codegen": "eager"})
    done()
    """
    cold = _run(script, tmp_path)
    assert _loaded(cold, HEAVY) == []
    assert ("cache", "stored") in _entries(cold)
    # the same program in another process: served from the cache, still nothing more
    warm = _run(script, tmp_path)
    assert ("cache", "hit") in _entries(warm)
    assert _loaded(warm, HEAVY) == []


def test_saved_tensor_hooks_load_the_tracer_and_the_placement(tmp_path: Path) -> None:
    script = """
    packed = []
    def pack(t):
        packed.append(1)
        return t * 2
    def unpack(t):
        return t / 2
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        run(mlp(), options={"codegen": "eager"})
    done(packed=len(packed))
    """
    result = _run(script, tmp_path)
    assert ("hooks", "placed") in _entries(result)
    assert result["packed"] > 0
    loaded = _loaded(result, HEAVY)
    for module in (
        "loom_tracer",
        "loom_cells",
        "loom_hops._hook_hops",
        "loom_hops._subgraph_hop",
        "loom_hops._placement",
        "loom_hops._saved_hooks",
    ):
        assert module in loaded
    assert not _loaded(result, ("loom_cudagraph._plan", "loom_hops._grad_hooks"))


def test_grad_hook_loads_its_operators_and_inlining(tmp_path: Path) -> None:
    script = """
    grads = []
    @torch.compile(backend="loom", options={"codegen": "eager"}, fullgraph=True)
    def f(x):
        y = torchloom.grad_hook(x * 2, lambda g: grads.append(g))
        return (y * y).sum()
    f(torch.randn(4, requires_grad=True)).backward()
    done(grads=len(grads))
    """
    result = _run(script, tmp_path)
    assert result["grads"] == 1
    loaded = _loaded(result, HEAVY)
    assert "loom_hops._grad_hooks" in loaded and "loom_hops._grad_hook_inline" in loaded
    assert ("grad_hooks", "inlined") in _entries(result)
    # served from the cache, the backward calls loom::grad_hook_replay: registered in time
    warm = _run(script, tmp_path)
    assert ("cache", "hit") in _entries(warm) and warm["grads"] == 1
    for run_ in (result, warm):
        assert not _loaded(run_, ("loom_hops._placement", "loom_cudagraph._plan"))


def test_cudagraphs_load_the_planner_and_runtime(tmp_path: Path) -> None:
    script = """
    import loom_cudagraph
    host = torchloom.Pipeline(capturer=loom_cudagraph.HostCapturer(), cudagraph_device="cpu")
    run(mlp(), backend=host, options={"codegen": "eager", "cudagraphs": True})
    done()
    """
    result = _run(script, tmp_path)
    assert ("cudagraph", "segment") in _entries(result)
    assert _loaded(result, ("loom_cudagraph._plan", "loom_cudagraph._runtime")) == [
        "loom_cudagraph._plan",
        "loom_cudagraph._runtime",
    ]


def test_torch_compile_imports_inductors_runtime_on_cuda_machines_as_inductor_does() -> None:
    """``torch.compile(backend="inductor")`` imports Inductor's runtime (what its
    generated modules import) at ``torch.compile()``; loom does the same where it is
    looked up on a machine with CUDA and Inductor codegen, so that a warm start does not
    pay it inside its first call. Without CUDA, or with eager codegen, it does not."""
    code = textwrap.dedent(
        """
        import json, os, sys, torch
        RUNTIME = "torch._inductor.select_algorithm"
        torch.compile(lambda x: x + 1, backend="loom")  # the lookup: this machine has no CUDA
        out = {"cpu": RUNTIME in sys.modules}
        from torchloom._backend import import_codegen_runtime
        torch.cuda.is_available = lambda: True
        os.environ["TORCHLOOM_CODEGEN"] = "eager"
        out["cuda_eager"] = [import_codegen_runtime(), RUNTIME in sys.modules]
        del os.environ["TORCHLOOM_CODEGEN"]
        out["cuda_inductor"] = [import_codegen_runtime(), RUNTIME in sys.modules]
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHLOOM_CODEGEN"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"cpu": False, "cuda_eager": [False, False], "cuda_inductor": [True, True]}
