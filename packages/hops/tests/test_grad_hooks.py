"""grad_hook: gradient hooks with Python side effects stay inside one compiled graph."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import loom_hops
from loom_hops import grad_hook


def _reference(y: torch.Tensor, *fns: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """What grad_hook means in eager PyTorch."""
    y = y.clone()
    for fn in fns:
        y.register_hook(fn)
    return y


def _program(hook: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Per call: a new closure over the call's own sink and scale, then a pure hook."""

    def f(x: torch.Tensor, sink: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2

        def record(g: torch.Tensor) -> None:
            sink.append(g * scale)

        y = hook(y, record, lambda g: g * 3)
        return (y * y + y.cos()).sum()

    return f


def _run_calls(f: Callable[..., torch.Tensor], x: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    """Three forwards, then their backwards in reverse order."""
    x = x.detach().requires_grad_(True)
    sinks: list[list[torch.Tensor]] = [[], [], []]
    outs = [f(x, sink, torch.tensor(10.0**i)) for i, sink in enumerate(sinks)]
    for out in reversed(outs):
        out.backward()
    assert x.grad is not None
    return sinks, x.grad


def _assert_same(got: tuple[list[Any], torch.Tensor], want: tuple[list[Any], torch.Tensor]) -> None:
    assert [len(s) for s in got[0]] == [len(s) for s in want[0]] == [1, 1, 1]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_eager_grad_hook_is_clone_then_register_hook() -> None:
    x = torch.randn(6)
    _assert_same(_run_calls(_program(grad_hook), x), _run_calls(_program(_reference), x))


def test_compiled_grad_hook_has_no_graph_break_and_matches_eager_per_call() -> None:
    x = torch.randn(6)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_program(grad_hook), backend=counter, fullgraph=True)
    _assert_same(_run_calls(compiled, x), _run_calls(_program(_reference), x))
    assert counter.frame_count == 1
    (graph,) = counter.graphs
    taps = [
        n
        for n in graph.graph.nodes
        if n.target in (torch.ops.loom.grad_tap, torch.ops.loom.grad_tap.default)
    ]
    assert len(taps) == 1


def test_explain_reports_no_graph_break() -> None:
    sink: list[torch.Tensor] = []
    explanation = torch._dynamo.explain(_program(grad_hook))(
        torch.randn(3, requires_grad=True), sink, torch.tensor(1.0)
    )
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_register_hook_with_side_effect_breaks_the_graph_grad_hook_does_not() -> None:
    calls: list[int] = []

    def with_register_hook(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.register_hook(lambda g: calls.append(1))
        return y.sum()

    def with_grad_hook(x: torch.Tensor) -> torch.Tensor:
        y = grad_hook(x.sin(), lambda g: calls.append(1))
        return y.sum()

    x = torch.randn(3, requires_grad=True)
    assert torch._dynamo.explain(with_register_hook)(x).graph_break_count == 1
    assert torch._dynamo.explain(with_grad_hook)(x).graph_break_count == 0


def test_backward_graph_calls_the_hook_op_and_the_tap_is_not_recomputed() -> None:
    graphs: dict[str, torch.fx.GraphModule] = {}

    def compiler(name: str) -> Any:
        def compile_graph(gm: torch.fx.GraphModule, _: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("fw"),
        bw_compiler=compiler("bw"),
        partition_fn=min_cut_rematerialization_partition,
    )
    calls: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return grad_hook(x.sin(), calls.append).cos().sum()

    x = torch.randn(5, requires_grad=True)
    torch.compile(f, backend=backend, fullgraph=True)(x).backward()
    targets = {name: [n.target for n in gm.graph.nodes] for name, gm in graphs.items()}
    assert torch.ops.loom.grad_tap.default in targets["fw"]
    assert torch.ops.loom.grad_hook.default in targets["bw"]
    assert torch.ops.loom.grad_tap.default not in targets["bw"]
    (seen,) = calls
    torch.testing.assert_close(seen, -x.detach().sin().sin())


def test_hook_result_replaces_the_gradient_and_hooks_run_in_order() -> None:
    order: list[str] = []

    def first(g: torch.Tensor) -> torch.Tensor:
        order.append("first")
        return g * 2

    def second(g: torch.Tensor) -> None:
        order.append("second")

    def third(g: torch.Tensor) -> torch.Tensor:
        order.append("third")
        return g + 1

    def f(x: torch.Tensor) -> torch.Tensor:
        return grad_hook(x * x, first, second, third).sum()

    x = torch.randn(4, requires_grad=True)
    torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
    assert order == ["first", "second", "third"]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, (1 * 2 + 1) * 2 * x.detach())


def test_retain_graph_runs_hooks_per_backward_and_hooks_are_freed_with_the_graph() -> None:
    gc.collect()
    before = loom_hops.bound_hook_count()
    calls: list[int] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return grad_hook(x.exp(), lambda g: calls.append(1)).sum()

    x = torch.randn(3, requires_grad=True)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    out.backward(retain_graph=True)
    assert loom_hops.bound_hook_count() == before + 1
    out.backward()
    assert len(calls) == 2
    del out
    gc.collect()
    assert loom_hops.bound_hook_count() == before


def test_a_forward_that_lost_its_hooks_does_not_shift_later_calls() -> None:
    seen: list[str] = []

    def f(x: torch.Tensor, tag: str) -> torch.Tensor:
        return grad_hook(x * 2, lambda g: seen.append(tag)).sum()

    x = torch.randn(2, requires_grad=True)
    out_a = f(x, "a")
    # A tap whose hooks were never stored (its forward raised before the store).
    torch.ops.loom.grad_tap(x * 2, 10**9)
    out_b = f(x, "b")
    out_b.backward()
    out_a.backward()
    assert seen == ["b", "a"]


def test_hook_returning_a_wrong_gradient_is_refused_with_its_name() -> None:
    def bad(g: torch.Tensor) -> torch.Tensor:
        return g.sum()

    x = torch.randn(3, requires_grad=True)
    out = grad_hook(x * 2, bad).sum()
    with pytest.raises(RuntimeError, match=r"hook '.*bad' returned a gradient of shape \(\)"):
        out.backward()


def test_hooking_a_tensor_without_grad_is_refused_as_register_hook_does() -> None:
    with pytest.raises(RuntimeError, match="doesn't require grad"):
        grad_hook(torch.randn(2), print)
    with pytest.raises(TypeError, match="at least one hook"):
        grad_hook(torch.randn(2, requires_grad=True))


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0
        self.tags: list[str] = []

    def count(self, g: torch.Tensor) -> None:
        self.calls += 1

    def tag(self, name: str, g: torch.Tensor) -> None:
        self.tags.append(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = grad_hook(self.lin(x), self.count, functools.partial(self.tag, "p"))
        return h.sum()


def test_bound_methods_and_partials_as_hooks_compile_once() -> None:
    model = _Recorder()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, 3)
    for _ in range(3):
        compiled(x).backward()
    assert (model.calls, model.tags) == (3, ["p", "p", "p"])
    assert counter.frame_count == 1
