"""Numbers a hook reads from its closure or globals become graph inputs where a torch op
uses them (``_lift.py``): the trace serves every value of the same type, and a number
that decides a branch, a shape or a dtype is still specialized and guarded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loom_tracer import GuardKind, TracedHook, trace_hook


def _traced(fn: Any, *args: Any) -> TracedHook:
    result = trace_hook(fn, args)
    assert isinstance(result, TracedHook), str(result)
    return result


def _closure(value: Any, body: Callable[[torch.Tensor, Any], Any]) -> Any:
    def hook(t: torch.Tensor) -> Any:
        return body(t, value)

    return hook


def _set(hook: Any, value: Any) -> None:
    (cell,) = hook.__closure__[1:]  # cell 0 is `body`
    cell.cell_contents = value


def _lifted(traced: TracedHook) -> list[str]:
    return [
        traced.input_sources[i].describe()
        for i in traced.outside_inputs
        if traced.input_numbers[i] is not None
    ]


def test_a_closure_float_is_a_graph_input_and_each_call_uses_its_value() -> None:
    hook = _closure(1.5, lambda t, s: t * s)
    x = torch.ones(3)
    tr = _traced(hook, x)
    assert _lifted(tr) == ["closure[1:value].cell_contents"]
    assert [g.kind for g in tr.guards if "value" in g.describe()] == [GuardKind.TYPE]
    for value in (1.5, 2.0, -0.25):
        _set(hook, value)
        assert tr.check_guards(x)
        torch.testing.assert_close(tr.run(x), hook(x))
    _set(hook, 3)  # an int: another dtype, another trace
    assert not tr.check_guards(x)


def test_arithmetic_on_read_numbers_is_recomputed_in_the_graph() -> None:
    hook = _closure(4.0, lambda t, s: t * (1.0 / s) + 2 * s)
    x = torch.ones(3)
    tr = _traced(hook, x)
    for value in (4.0, 0.5):
        _set(hook, value)
        assert tr.check_guards(x)
        torch.testing.assert_close(tr.run(x), hook(x))


def test_an_int_in_tensor_arithmetic_is_lifted_but_not_one_that_decides_a_shape() -> None:
    x = torch.ones(4, 2)
    arith = _closure(3, lambda t, n: t * n)
    tr = _traced(arith, x)
    assert _lifted(tr) == ["closure[1:value].cell_contents"]
    _set(arith, 5)
    assert tr.check_guards(x)
    torch.testing.assert_close(tr.run(x), arith(x))
    shaped = _closure(4, lambda t, n: t.reshape(n, -1))
    tr = _traced(shaped, x)
    _set(shaped, 2)
    assert not tr.check_guards(x), "a size is specialized"


def test_a_number_that_decides_a_branch_is_guarded_by_value() -> None:
    hook = _closure(2.0, lambda t, s: t * 2 if s > 1.0 else t)
    x = torch.ones(3)
    tr = _traced(hook, x)
    _set(hook, 3.0)
    assert not tr.check_guards(x)


def test_a_lifted_number_keeps_the_result_dtype_a_python_number_gives() -> None:
    # NOTE: int tensor * Python float is float32; with a float64 0-d tensor it would be
    # float64, and 1.0 / (0-d float32) would be float64: the input is cast to float32.
    for body, x in (
        (lambda t, s: t * s, torch.ones(3, dtype=torch.int32)),
        (lambda t, s: t * (s / t.sum()), torch.ones(3)),
    ):
        hook = _closure(0.5, body)
        tr = _traced(hook, x)
        assert _lifted(tr) == ["closure[1:value].cell_contents"]
        for value in (0.5, 0.75):
            _set(hook, value)
            assert tr.check_guards(x)
            got, want = tr.run(x), hook(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)


def test_numbers_inside_the_arguments_stay_constants() -> None:
    def unpack(p: Any) -> torch.Tensor:
        return p[1] * p[0]

    tr = _traced(unpack, (2.0, torch.ones(3)))
    assert tr.outside_inputs == ()
