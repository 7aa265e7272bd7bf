"""inline_grad_hooks: traced grad_hook hooks inlined into the backward, side effects exact."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import loom_hops
from loom_hops import grad_hook

SCALE = torch.tensor(3.0)
CALLS = [0]


def _backend(results: list[loom_hops.GradHookInlining]) -> Any:
    def bw_compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
        results.append(loom_hops.inline_grad_hooks(gm))
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=bw_compiler
    )


def _double_plus_one(g: torch.Tensor) -> torch.Tensor:
    return g * 2 + 1


def _step(x: torch.Tensor, sink: Any) -> torch.Tensor:
    """A closure recreated per call over the call's sink, a global counter, a pure hook."""

    def record(g: torch.Tensor) -> None:
        sink.append(g.norm())
        CALLS[0] += 1

    y = grad_hook(x.sin() * 2, record, _double_plus_one, lambda g: sink.append(g.sum()))
    return (y * y).sum()


def _run(fn: Callable[..., torch.Tensor], x: torch.Tensor, sinks: list[Any]) -> tuple[Any, ...]:
    """Three forwards, then their backwards in reverse order."""
    x = x.detach().requires_grad_(True)
    CALLS[0] = 0
    outs = [fn(x, sink) for sink in sinks]
    for out in reversed(outs):
        out.backward()
    return [list(s) for s in sinks], CALLS[0], x.grad


def _compare(
    sinks: Callable[[], list[Any]], caplog: pytest.LogCaptureFixture
) -> tuple[loom_hops.GradHookInlining, list[str]]:
    """Eager vs compiled with inlining: same records, calls and gradients."""
    x = torch.randn(5)
    want = _run(_step, x, sinks())
    results: list[loom_hops.GradHookInlining] = []
    compiled = torch.compile(_step, backend=_backend(results), fullgraph=True)
    with caplog.at_level(logging.DEBUG, logger="torchloom.hops"):
        got = _run(compiled, x, sinks())
    assert got[1] == want[1] == 3
    assert [len(s) for s in got[0]] == [2, 2, 2]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2], want[2])
    (inlining,) = results
    return inlining, [r.getMessage() for r in caplog.records]


def test_traced_hooks_are_inlined_and_replayed_per_call(caplog: pytest.LogCaptureFixture) -> None:
    inlining, messages = _compare(lambda: [[], [], []], caplog)
    assert inlining.kept_opaque == ()
    assert len(inlining.inlined) == 1
    targets = [n.target for n in inlining.result.graph_module.graph.nodes]
    assert torch.ops.loom.grad_hook_replay.default in targets
    assert torch.ops.loom.grad_hook.default not in targets
    assert torch.ops.aten.linalg_vector_norm.default in targets  # the hook's tensor work
    assert not [m for m in messages if "does not match its trace" in m]


HOLDER: dict[str, Any] = {}


def _record_into_holder(x: torch.Tensor) -> torch.Tensor:
    return (grad_hook(x.cos(), lambda g: HOLDER["sink"].append(g.norm())) ** 2).sum()


def test_a_call_whose_hooks_do_not_match_the_trace_runs_them_as_python(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The trace guards `type(HOLDER['sink']) is list`; Dynamo never sees HOLDER.
    results: list[loom_hops.GradHookInlining] = []
    compiled = torch.compile(_record_into_holder, backend=_backend(results), fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    sinks: list[Any] = [[], collections.deque()]
    with caplog.at_level(logging.DEBUG, logger="torchloom.hops"):
        for sink in sinks:
            HOLDER["sink"] = sink
            compiled(x).backward()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "does not match its trace" in m]) == 1
    (inlining,) = results
    assert len(inlining.inlined) == 1
    want = (2 * x.detach().cos()).norm()
    torch.testing.assert_close([list(s) for s in sinks], [[want], [want]])


def _append_builtin(x: torch.Tensor, sink: list[torch.Tensor]) -> torch.Tensor:
    return grad_hook(x.exp(), sink.append).sum()


def _reads_global_tensor(x: torch.Tensor, sink: list[torch.Tensor]) -> torch.Tensor:
    return grad_hook(x.exp(), lambda g: sink.append(g * SCALE)).sum()


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (_append_builtin, "not a plain Python function"),
        (_reads_global_tensor, "reads tensors from its closure or globals"),
    ],
)
def test_hooks_the_tracer_cannot_inline_stay_python_calls_with_the_reason(
    fn: Callable[..., torch.Tensor], why: str
) -> None:
    x = torch.randn(3)
    want: list[torch.Tensor] = []
    xe = x.clone().requires_grad_(True)
    fn(xe, want).backward()
    results: list[loom_hops.GradHookInlining] = []
    got: list[torch.Tensor] = []
    xc = x.clone().requires_grad_(True)
    torch.compile(fn, backend=_backend(results), fullgraph=True)(xc, got).backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xc.grad, xe.grad)
    (inlining,) = results
    assert inlining.inlined == ()
    ((_, reason),) = inlining.kept_opaque
    assert why in reason
    targets = [n.target for n in inlining.result.graph_module.graph.nodes]
    assert torch.ops.loom.grad_hook.default in targets


def _count_python_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from loom_hops import _grad_hook_inline

    runs = [0]
    run_hooks = _grad_hook_inline.run_hooks

    def counting(*args: Any) -> torch.Tensor:
        runs[0] += 1
        return run_hooks(*args)

    monkeypatch.setattr(_grad_hook_inline, "run_hooks", counting)
    return runs


def test_a_backward_loaded_in_another_process_finds_its_traces_from_the_calls_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replay key is content-derived: a backward served from a cache in a fresh
    process (no traces in memory) traces the hooks of its first call and, finding the
    key again, replays them instead of running them as Python."""
    from loom_hops import _grad_hook_inline

    x = torch.randn(5)
    want = _run(_step, x, [[], [], []])
    results: list[loom_hops.GradHookInlining] = []
    compiled = torch.compile(_step, backend=_backend(results), fullgraph=True)
    _run(compiled, x, [[], [], []])
    replay = torch.ops.loom.grad_hook_replay.default
    nodes = results[0].result.graph_module.graph.nodes
    keys = [n.args[3] for n in nodes if n.target is replay]
    assert len(keys) == 1
    monkeypatch.setattr(_grad_hook_inline, "_traced", {})
    runs = _count_python_runs(monkeypatch)
    got = _run(compiled, x, [[], [], []])
    assert runs[0] == 0 and list(_grad_hook_inline._traced) == keys
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2], want[2])


def test_hooks_that_do_not_trace_to_the_key_run_as_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom_hops import _grad_hook_inline

    results: list[loom_hops.GradHookInlining] = []
    compiled = torch.compile(_record_into_holder, backend=_backend(results), fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    HOLDER["sink"] = []
    compiled(x).backward()
    monkeypatch.setattr(_grad_hook_inline, "_traced", {})
    monkeypatch.setattr(_grad_hook_inline, "_retrace_failed", set())
    runs = _count_python_runs(monkeypatch)
    sink: Any = collections.deque()  # the trace guarded `type(...) is list`
    HOLDER["sink"] = sink
    compiled(x).backward()
    assert runs[0] == 1 and not _grad_hook_inline._traced
    torch.testing.assert_close(list(sink), [(2 * x.detach().cos()).norm()])
