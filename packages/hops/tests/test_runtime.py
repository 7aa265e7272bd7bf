"""Runtime: a compilation is reused under any pair equal by content to the one it placed
(not only the same objects); eager packing is off."""

from __future__ import annotations

from typing import Any

import hook_modules as hm
import pytest
import torch
from _hooks_backend import hooks_backend

import loom_hops


def _step(fn: Any, x: torch.Tensor) -> None:
    fn(x).sum().backward()


def test_other_hooks_recompile_and_the_same_hooks_reuse() -> None:
    model = torch.nn.Linear(4, 4)
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend)
    x = torch.randn(2, 4, requires_grad=True)
    a, b = hm.bf16(), hm.fp8()
    with torch.autograd.graph.saved_tensors_hooks(*a):
        _step(fn, x)
        _step(fn, x)
    assert log.compiles == 1
    with torch.autograd.graph.saved_tensors_hooks(*b):
        _step(fn, x)
    assert log.compiles == 2
    with torch.autograd.graph.saved_tensors_hooks(*a):
        _step(fn, x)
    _step(fn, x)
    assert log.compiles == 3  # no hooks is a variant too


def test_python_hooks_changing_between_calls_recompile() -> None:
    seen: list[str] = []

    def make(tag: str) -> tuple[Any, Any]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.append(tag)
            return t

        return pack, lambda t: t

    backend, log = hooks_backend()
    fn = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    x = torch.randn(2, 4, requires_grad=True)
    for tag in ("a", "b"):
        with torch.autograd.graph.saved_tensors_hooks(*make(tag)):
            _step(fn, x)
    assert log.compiles == 2
    assert set(seen) == {"a", "b"}  # refused pairs stay eager, each with its own hook


def test_save_on_cpu_entered_for_every_step_compiles_once() -> None:
    """``save_on_cpu()`` makes two new closures each time it is entered."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend)
    x = torch.randn(2, 4)
    for _ in range(10):
        with torch.autograd.graph.save_on_cpu(device_type="cpu"):
            got = fn(x)
        got.sum().backward()
    assert log.compiles == 1
    placement = log.placements[0]
    assert isinstance(placement, loom_hops.Placement) and placement.packed


def test_hooks_made_per_call_reuse_the_compilation_and_keep_their_own_state() -> None:
    def make(log: list[tuple[int, ...]]) -> tuple[Any, Any]:
        def pack(t: torch.Tensor) -> Any:
            log.append(tuple(t.shape))
            return (t.dtype, t.to(torch.bfloat16))

        return pack, lambda p: p[1].to(p[0])

    backend, log = hooks_backend()
    fn = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    x = torch.randn(2, 4, requires_grad=True)
    logs: list[list[tuple[int, ...]]] = [[], [], []]
    for packed in logs:
        with torch.autograd.graph.saved_tensors_hooks(*make(packed)):
            _step(fn, x)
    assert log.compiles == 1
    assert logs[0] and logs[0] == logs[1] == logs[2]  # each pair's list got its own call


def test_no_grad_calls_pack_nothing() -> None:
    calls = {"n": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return t

    backend, _ = hooks_backend()
    fn = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(torch.randn(2, 4))
    assert calls["n"] == 0


def test_pushing_hooks_inside_a_disabled_region_says_why() -> None:
    with (
        loom_hops.eager_saved_tensors_hooks_disabled(),
        pytest.raises(RuntimeError, match="torchloom placed"),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    ):
        pass


def test_disabled_region_saves_tensors_without_hooks_and_restores() -> None:
    calls = {"n": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return t

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with loom_hops.eager_saved_tensors_hooks_disabled():
            x.sin().sum().backward()
        assert calls["n"] == 0
        x.sin().sum().backward()
    assert calls["n"] == 1


def test_the_guard_needs_a_dynamo_compile() -> None:
    assert loom_hops.install_hooks_guard(None) is False
