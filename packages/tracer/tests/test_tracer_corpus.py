"""Every corpus hook, traced and run (graph + replay), matches CPython running it."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loom_tracer import HookUnsupported, TracedHook, trace_hook

sys.path.insert(0, str(Path(__file__).parent))
import corpus
from corpus import CASES, Case, Setup


def assert_same(expected: Any, actual: Any, path: str = "result") -> None:
    """Same tensors (bitwise), same containers, same object state."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (expected.dtype, expected.shape, expected.device) == (
            actual.dtype,
            actual.shape,
            actual.device,
        ), path
        assert actual.requires_grad in (False, expected.requires_grad), path  # values, not history
        a, b = expected.detach(), actual.detach()
        if a.dtype.itemsize == 1 and a.is_floating_point():
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), path
        return
    assert type(expected) is type(actual), f"{path}: {type(expected)} != {type(actual)}"
    if isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        aliases = [
            (i, j) for i in range(len(expected)) for j in range(i) if expected[i] is expected[j]
        ]
        assert all(actual[i] is actual[j] for i, j in aliases), f"{path}: aliasing differs"
        for i, (x, y) in enumerate(zip(expected, actual, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
        if hasattr(expected, "__dict__"):
            assert_same(vars(expected), vars(actual), f"{path}.__dict__")
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, corpus._Globals):
        assert_same(expected.value(), actual.value(), f"{path}.{expected.name}")
    elif type(expected).__name__ == "cell":
        assert_same(expected.cell_contents, actual.cell_contents, f"{path}.cell_contents")
    elif hasattr(expected, "__dict__") and not isinstance(expected, type):
        assert_same(vars(expected), vars(actual), f"{path}.__dict__")
    else:
        assert expected == actual, f"{path}: {expected!r} != {actual!r}"


def run_traced(hook: Any, args: tuple[Any, ...], cache: dict[Any, TracedHook]) -> Any:
    """Run through the tracer, retracing when the guards of the cached trace fail."""
    traced = cache.get(hook)
    if traced is None or not traced.check_guards(*args):
        result = trace_hook(hook, args)
        assert isinstance(result, TracedHook), str(result)
        traced = cache[hook] = result
        assert traced.check_guards(*args), traced.guard_source
    traced.replay.check()
    return traced.run(*args)


def check_against_cpython(case: Case, calls: int = 2) -> None:
    """The differential helper: same outputs and same final state, call after call
    (and tracing alone leaves the state untouched)."""
    eager, traced, untouched = case.build(), case.build(), case.build()
    cache: dict[Any, TracedHook] = {}
    first = trace_hook(traced.hook, traced.args)
    assert isinstance(first, TracedHook), str(first)
    assert_same(untouched.state, traced.state, "state after tracing")  # tracing changes nothing
    cache[traced.hook] = first
    for _ in range(calls):
        for e_hook, t_hook in zip(
            (eager.hook, *eager.extra_hooks), (traced.hook, *traced.extra_hooks), strict=True
        ):
            expected = e_hook(*eager.args)
            actual = run_traced(t_hook, traced.args, cache)
            assert_same(expected, actual)
            assert_same(eager.state, traced.state, "state")


def refused_line(setup: Setup) -> str:
    """file:line of the ``# <- refused`` marker in the hook or the functions it calls."""
    candidates = [setup.hook] + [v for v in vars(corpus).values() if inspect.isfunction(v)]
    for fn in candidates:
        lines, start = inspect.getsourcelines(fn)
        for i, line in enumerate(lines):
            if (
                "# <- refused" in line
                and fn.__code__.co_filename == setup.hook.__code__.co_filename
            ):
                if fn is setup.hook or fn.__name__ in setup.hook.__code__.co_names:
                    return f"{os.path.basename(fn.__code__.co_filename)}:{start + i}"
    raise AssertionError("no '# <- refused' marker")


SUPPORTED = [c for c in CASES if c.refusal is None]
REFUSED = [c for c in CASES if c.refusal is not None]


def test_corpus_has_at_least_forty_hooks() -> None:
    assert len(CASES) >= 40
    assert len(REFUSED) >= 10


@pytest.mark.parametrize("case", SUPPORTED, ids=[c.name for c in SUPPORTED])
def test_traced_hook_matches_cpython(case: Case) -> None:
    check_against_cpython(case)


MUTATED = [c for c in SUPPORTED if c.mutate is not None]


@pytest.mark.parametrize("case", MUTATED, ids=[c.name for c in MUTATED])
def test_guards_fail_when_a_watched_value_changes(case: Case) -> None:
    setup = case.build()
    traced = trace_hook(setup.hook, setup.args)
    assert isinstance(traced, TracedHook), str(traced)
    assert traced.check_guards(*setup.args)
    assert case.mutate is not None
    case.mutate(setup)
    assert not traced.check_guards(*setup.args)


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_unsupported_hook_is_refused_with_reason_and_line(case: Case) -> None:
    setup = case.build()
    result = trace_hook(setup.hook, setup.args)
    assert isinstance(result, HookUnsupported), "expected a refusal"
    assert result.kind is case.refusal, str(result)
    assert result.where == refused_line(setup), str(result)
    assert result.explanation
