"""The loom backend end to end on small functions: registration, training and
inference graphs, fallback and strict mode, report and logging."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torchloom
from torchloom import GraphKind, LoomRefusal, Pipeline, RefusalKind, Unsupported

EAGER = {"codegen": "eager"}


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torchloom.reset()
    yield
    torchloom.reset()


def test_backend_is_found_through_the_entry_point_in_a_fresh_interpreter() -> None:
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x.cos() + 1, backend='loom', options={'codegen': 'eager'})\n"
        "x = torch.randn(3)\n"
        "assert torch.allclose(f(x), x.cos() + 1)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("ok")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_training_graph_matches_eager_outputs_and_gradients() -> None:
    ref, model = _mlp(), _mlp()
    compiled = torch.compile(model, backend="loom", options=EAGER)
    x = torch.randn(5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref(x).pow(2).sum().backward()
    compiled(x2).pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    kinds = [k for g in torchloom.report() for k, _ in g.graphs]
    assert "forward" in kinds and "backward" in kinds


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_inference_graph_under_no_grad_and_inference_mode(ctx: type) -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="loom", options=EAGER)
    x = torch.randn(5, 8)
    with ctx():
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
    kinds = [k for g in torchloom.report() for k, _ in g.graphs]
    assert "inference" in kinds and "backward" not in kinds


def test_report_has_ids_input_metadata_and_timed_stages() -> None:
    f = torch.compile(lambda x, y: (x @ y).relu(), backend="loom", options=EAGER)
    f(torch.randn(2, 3, requires_grad=True), torch.randn(3, 4))
    rep = torchloom.report()
    assert len(rep) == 1
    g = rep[0]
    assert g.graph_id == 0
    assert [(m.kind, m.dtype, m.shape, m.requires_grad) for m in g.inputs] == [
        ("tensor", "float32", ("2", "3"), True),
        ("tensor", "float32", ("3", "4"), False),
    ]
    names = {s.name for s in g.stages}
    assert {"aot", "partition", "compile.forward", "hooks.prepare", "cache.key"} <= names
    assert all(s.seconds >= 0 for s in g.stages)
    assert {s.owner for s in g.stages if s.name in ("aot", "partition", "compile.forward")} == {
        "torch"
    }
    assert {s.owner for s in g.stages if s.name.startswith(("cache.", "hooks."))} == {"loom"}
    assert 0 < g.loom_seconds < g.compile_seconds
    assert "graph 0" in rep.format() and "loom's own stages" in rep.format()


def test_nested_sections_keep_only_their_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchloom._report as report_module

    # A scripted clock: outer starts at 0, inner runs 3..8, outer ends at 10.
    ticks = iter([0.0, 3.0, 8.0, 10.0])
    monkeypatch.setattr(report_module.time, "perf_counter", lambda: next(ticks))
    record = report_module.new_record("t", [], {})
    with record.timed("outer"), record.timed("inner", owner="torch"):
        pass
    inner, outer = record.build().stages
    assert (inner.name, inner.owner, inner.seconds) == ("inner", "torch", 5.0)
    assert (outer.name, outer.owner, outer.seconds) == ("outer", "loom", 5.0)
    assert record.build().loom_seconds == 5.0 and record.build().compile_seconds == 10.0


def test_graph_without_tensor_work_runs_eagerly_with_a_logged_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f = torch.compile(lambda x: x, backend="loom", options=EAGER)
    x = torch.randn(3)
    with caplog.at_level(logging.DEBUG, logger="torchloom"):
        assert f(x) is x or torch.equal(f(x), x)
    for g in torchloom.report():
        assert g.fallback is None or "no tensor work" in g.fallback


def _refuse_everything(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    reason = Unsupported(RefusalKind.STAGE_REFUSED, "test.py:1", "test pass refuses", "do not")
    raise LoomRefusal(reason)


REFUSING = Pipeline(dynamo_passes=(_refuse_everything,))


def test_refused_graph_falls_back_to_eager_with_reason_in_log_and_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    f = torch.compile(lambda x: x.sin() * 3, backend=REFUSING, options=EAGER)
    x = torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="torchloom"):
        torch.testing.assert_close(f(x), x.sin() * 3)
    assert "test pass refuses" in caplog.text
    (g,) = torchloom.report()
    assert g.fallback is not None and "test.py:1" in g.fallback
    assert g.refusal is not None and g.fallback == str(g.refusal)
    assert (g.refusal.kind, g.refusal.where, g.refusal.hint) == (
        RefusalKind.STAGE_REFUSED,
        "test.py:1",
        "do not",
    )


def test_strict_mode_raises_the_refusal() -> None:
    f = torch.compile(lambda x: x.sin() * 3, backend=REFUSING, options={**EAGER, "strict": True})
    with pytest.raises(Exception, match="test pass refuses"):
        f(torch.randn(4))


def test_invalid_option_raises_when_compiling() -> None:
    f = torch.compile(lambda x: x + 1, backend="loom", options={"nope": 1})
    with pytest.raises(Exception, match="unknown loom option 'nope'"):
        f(torch.randn(2))


class _WatchBackwardInputs:
    """Wraps each compiled backward to see how many inputs it left in its list."""

    def __init__(self) -> None:
        self.left_after_call: list[int] = []

    def __call__(self, kind: GraphKind, fn: Callable[..., Any]) -> Callable[..., Any]:
        if kind is not GraphKind.BACKWARD:
            return fn

        def watched(args: list[Any]) -> Any:
            out = fn(args)
            self.left_after_call.append(len(args))
            return out

        watched._boxed_call = True  # type: ignore[attr-defined]
        return watched


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_backward_takes_its_inputs_boxed_and_clears_them(codegen: str) -> None:
    """The backward gets the saved tensors in a list it empties, so each one can
    be freed at its last use rather than when the backward returns."""
    watch = _WatchBackwardInputs()
    f = torch.compile(
        lambda x: (x.exp() * x).sum(),
        backend=Pipeline(compiled_wrappers=(watch,)),
        options={"codegen": codegen},
    )
    x = torch.randn(64, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, (x.exp() * x + x.exp()).detach())
    assert watch.left_after_call == [0]


def test_compiled_function_keeps_no_tensor_of_its_first_call() -> None:
    """Dynamo's example inputs are the first call's tensors; AOTAutograd keeps
    loom's compilers for the lazy backward, which must not keep those alive
    (after a graph break they are activations of the previous graph)."""
    import gc
    import weakref

    f = torch.compile(lambda h: (h.tanh() * 2).sum(), backend="loom", options=EAGER)
    h = torch.randn(256, requires_grad=True) * 3  # an activation, as after a graph break
    first = weakref.ref(h)
    f(h).backward()
    f(torch.randn(256, requires_grad=True) * 3).backward()
    del h
    gc.collect()
    assert first() is None


def test_debug_log_prints_each_stage_graph(caplog: pytest.LogCaptureFixture) -> None:
    f = torch.compile(lambda x: x.tanh() * 2, backend="loom", options=EAGER)
    with caplog.at_level(logging.DEBUG, logger="torchloom.graphs"):
        f(torch.randn(3, requires_grad=True))
    text = caplog.text
    assert "dynamo" in text and "forward" in text and "tanh" in text


@pytest.mark.inductor
def test_inductor_codegen_matches_eager_in_training() -> None:
    ref, model = _mlp(), _mlp()
    compiled = torch.compile(model, backend="loom")
    x = torch.randn(5, 8)
    ref(x).sum().backward()
    compiled(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert any(s.detail == "inductor" for g in torchloom.report() for s in g.stages)


def test_graph_aot_cannot_trace_falls_back_with_user_location(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(kind: GraphKind, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        raise ValueError("codegen exploded")

    pipeline = Pipeline(graph_passes=(broken,))

    def user_fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    f = torch.compile(user_fn, backend=pipeline, options=EAGER)
    x = torch.randn(3)
    with caplog.at_level(logging.WARNING, logger="torchloom"):
        torch.testing.assert_close(f(x), x.sin() + 1)
    strict = torch.compile(user_fn, backend=pipeline, options={**EAGER, "strict": True})
    torch._dynamo.reset()
    with pytest.raises(Exception, match="codegen exploded"):
        strict(x)
    (g, *_) = torchloom.report()
    assert g.fallback is not None
    line = user_fn.__code__.co_firstlineno + 1
    assert "codegen exploded" in g.fallback
    assert f"test_backend.py:{line} in user_fn" in g.fallback


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    "signal",
    [
        torch._dynamo.exc.TensorifyScalarRestartAnalysis(),
        torch._dynamo.exc.RestartAnalysis(),
        torch._dynamo.exc.SkipFrame("skip"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_dynamo_control_flow_exceptions_propagate_and_are_never_a_fallback(
    signal: BaseException, strict: bool
) -> None:
    def signal_inside_aot(
        fw: torch.fx.GraphModule, bw: torch.fx.GraphModule
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        raise signal

    gm = torch.fx.symbolic_trace(lambda x: ((x.sin() * 3).sum(),))
    pipeline = Pipeline(partition_passes=(signal_inside_aot,))
    with pytest.raises(type(signal)):
        pipeline(
            gm,
            [torch.randn(4, requires_grad=True)],
            options={**EAGER, "strict": strict, "cache": False},
        )
    (g,) = torchloom.report()
    assert g.fallback is None
    assert [e.kind for e in g.entries if e.area == "pipeline"] == ["restart"]


@pytest.mark.parametrize(
    ("device", "wakes"),
    [
        pytest.param("cpu", 0, marks=pytest.mark.inductor),
        pytest.param("cuda", 1, marks=pytest.mark.gpu),
    ],
)
def test_a_cold_inductor_compile_wakes_the_compile_workers_for_gpu_inputs_only(
    device: str, wakes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``compile_fx`` does on entry: GPU inputs wake the worker pool before
    AOTAutograd traces (Triton kernels then compile in parallel from the first one);
    CPU inputs start no pool (C++ kernels compile on threads)."""
    from torch._inductor.async_compile import AsyncCompile

    calls: list[str] = []
    wakeup = AsyncCompile.wakeup

    def counting() -> None:
        calls.append("wakeup")
        wakeup()

    monkeypatch.setattr(AsyncCompile, "wakeup", staticmethod(counting))
    f = torch.compile(lambda x: x.sin() + 1, backend="loom", options={"cache": False})
    x = torch.randn(8, device=device)
    torch.testing.assert_close(f(x), x.sin() + 1)
    assert calls == ["wakeup"] * wakes
