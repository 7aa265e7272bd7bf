"""``backend="loom"`` on every Python (issue 38): the issue's example with fp8
saved-tensor hooks on the running one; and on a Python whose bytecode the hook
tracer does not know, importing never fails, graphs without hooks compile,
saved-tensor hooks are refused with ``unsupported_python`` and run eagerly with
eager's gradients, and only ``strict=True`` raises.

The unknown Python is simulated in a child process: the tracer's ``_pyversion`` is
loaded under a fake ``sys.version_info`` (3.15), and the hook's first opcode is
renamed (removed from ``dis.opmap`` while the tracer registers its handlers); torch
and everything else see the real interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import torch

import torchloom

OPTS: dict[str, Any] = {"codegen": "eager", "cache": False}

_SCRIPT = textwrap.dedent(
    """
    import dis, importlib.util, json, pathlib, sys
    import torch, torch._dynamo, torchloom  # Dynamo's tables from the real dis.opmap

    def pack(t):
        return (t.dtype, t.to(torch.bfloat16))

    def unpack(p):
        return p[1].to(p[0])

    renamed = next(i.opname for i in dis.get_instructions(pack) if i.opname != "RESUME")
    opcode = dis.opmap.pop(renamed)
    folder = pathlib.Path(importlib.util.find_spec("loom_tracer").origin).parent
    spec = importlib.util.spec_from_file_location("loom_tracer._pyversion", folder / "_pyversion.py")
    pyversion = importlib.util.module_from_spec(spec)
    real, sys.version_info = sys.version_info, (3, 15, 0, "alpha", 0)
    try:
        spec.loader.exec_module(pyversion)
    finally:
        sys.version_info = real
    sys.modules[spec.name] = pyversion
    import loom_hops, loom_tracer  # registration under the unknown Python
    dis.opmap[renamed] = opcode  # Dynamo's own bytecode work needs the real table

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
        )

    def step(fn, m, hooks):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            fn(x).square().sum().backward()
        return [x.grad, *(p.grad for p in m.parameters())]

    options = {"codegen": "eager", "cache": False}
    out = {"renamed": renamed}
    m = model()
    plain = torch.compile(m, backend="loom", options=options)(torch.ones(8, 16))
    out["plain_equal"] = bool(torch.equal(plain, m(torch.ones(8, 16))))
    out["plain_entries"] = [e.kind for e in torchloom.report().entries("hooks")]

    torchloom.reset()
    m = model()
    got = step(torch.compile(m, backend="loom", options=options), m, (pack, unpack))
    want_m = model()
    want = step(want_m, want_m, (pack, unpack))
    out["grads_equal"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    out["refused"] = [
        (e.get("kind_"), e.message) for e in torchloom.report().entries("hooks")
        if e.kind == "refused"
    ]

    torch._dynamo.reset()
    m = model()
    strict = torch.compile(m, backend="loom", options={**options, "strict": True})
    try:
        step(strict, m, (pack, unpack))
        out["strict"] = None
    except Exception as exc:
        out["strict"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    """
)


def _run() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_an_unknown_python_compiles_graphs_and_refuses_hooks_unless_strict() -> None:
    got = _run()
    assert got["plain_equal"] and "refused" not in got["plain_entries"]
    assert got["grads_equal"]  # the hooks ran eagerly, as in eager PyTorch
    ((kind, message),) = got["refused"]
    assert kind == "hook_not_traceable"
    assert "unsupported_python" in message and "CPython 3.15" in message
    assert f"first opcode unknown to the tracer is {got['renamed']}" in message
    assert got["strict"] is not None and "unsupported_python" in got["strict"]


FP8_MAX = 448.0


def fp8_pack(t: torch.Tensor) -> Any:
    scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (t.dtype, (t / scale).to(torch.float8_e4m3fn), scale)


def fp8_unpack(p: Any) -> torch.Tensor:
    dtype, q, scale = p
    return (q.to(torch.float32) * scale).to(dtype)


def _issue_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _fp8_step(fn: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(fp8_pack, fp8_unpack):
        out = fn(x)
    out.square().sum().backward()
    assert x.grad is not None
    return [out.detach(), x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


def test_the_issue_example_compiles_and_places_fp8_hooks_on_this_python() -> None:
    """Issue 38's example on the running Python (CI runs it on 3.11 and 3.13): it
    compiles, and with an fp8 ``saved_tensors_hooks`` pair the hooks are placed in the
    graphs with eager's outputs and gradients."""
    torchloom.reset()
    model = _issue_model()
    compiled = torch.compile(model, backend="loom", options=OPTS)
    x = torch.randn(8, 16)
    torch.testing.assert_close(compiled(x), model(x))

    torchloom.reset()
    model = _issue_model()
    got = _fp8_step(torch.compile(model, backend="loom", options=OPTS), model)
    eager = _issue_model()
    want = _fp8_step(eager, eager)
    placed = [e for e in torchloom.report().entries("hooks") if e.kind == "placed"]
    assert placed and placed[0].get("packed"), torchloom.report().format()
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
