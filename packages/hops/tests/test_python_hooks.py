"""Python saved-tensor hooks: traced per saved tensor, placed, side effects replayed in order."""

from __future__ import annotations

from typing import Any

import torch
from _hooks_backend import hooks_backend

import loom_hops


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


class Recorder:
    """A counter and a list of packed shapes, kept by a Python hook pair."""

    def __init__(self) -> None:
        self.stats = {"packed": 0, "unpacked": 0}
        self.shapes: list[tuple[int, ...]] = []

    def hooks(self) -> tuple[Any, Any]:
        stats, shapes = self.stats, self.shapes

        def pack(t: torch.Tensor) -> Any:
            stats["packed"] += 1
            shapes.append(tuple(t.shape))
            return (t.dtype, t.to(torch.bfloat16))

        def unpack(p: Any) -> torch.Tensor:
            stats["unpacked"] += 1
            return p[1].to(p[0])

        return pack, unpack


def _step(fn: Any, x: torch.Tensor, hooks: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        out = fn(x)
    out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_python_hooks_are_placed_and_match_eager() -> None:
    model, x = _mlp(), torch.randn(4, 8)
    eager, compiled = Recorder(), Recorder()
    grads_e = _step(model, x, eager.hooks(), model)
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend)
    grads_c = _step(fn, x, compiled.hooks(), model)
    (placement,) = log.placements
    assert isinstance(placement, loom_hops.Placement) and placement.packed
    for a, b in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(a, b)
    # one replay per tensor the compiled function saves, with that tensor's values
    n = len(placement.packed)
    assert compiled.stats == {"packed": n, "unpacked": n}
    assert sorted(compiled.shapes) == sorted(
        tuple(int(d) for d in p.shape) for p in placement.packed
    )
    assert sorted(set(compiled.shapes)) == sorted(set(eager.shapes))
    # here the partitioner saves what eager saves: the replay order is eager's too
    assert compiled.shapes == eager.shapes


def test_side_effects_replay_on_every_call_not_at_compile_time() -> None:
    model, x = _mlp(), torch.randn(4, 8)
    rec = Recorder()
    hooks = rec.hooks()
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend)
    _step(fn, x, hooks, model)
    first = dict(rec.stats)
    _step(fn, x, hooks, model)
    assert log.compiles == 1
    assert rec.stats == {k: 2 * v for k, v in first.items()}


def test_a_changed_closure_value_recompiles() -> None:
    limit = {"numel": 10_000}

    def pack(t: torch.Tensor) -> Any:
        if t.numel() > limit["numel"]:
            return (t.dtype, t.to(torch.bfloat16))
        return (t.dtype, t)

    def unpack(p: Any) -> torch.Tensor:
        return p[1].to(p[0])

    model, x = _mlp(), torch.randn(4, 8)
    backend, log = hooks_backend()
    fn = torch.compile(model, backend=backend)
    _step(fn, x, (pack, unpack), model)
    _step(fn, x, (pack, unpack), model)
    assert log.compiles == 1
    limit["numel"] = 16  # now the 32x8 weights and activations are packed to bf16
    grads_c = _step(fn, x, (pack, unpack), model)
    assert log.compiles == 2
    grads_e = _step(model, x, (pack, unpack), model)
    for a, b in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(a, b)
    second = log.placements[-1]
    assert isinstance(second, loom_hops.Placement)
    saved = list(second.forward.graph.output_node().args[0])[second.num_fwd_outputs :]
    assert any(n.meta["val"].dtype == torch.bfloat16 for n in saved)


def test_an_unpack_refusal_names_the_users_function_not_looms_wrapper() -> None:
    from loom_hops._python_hooks import TracedPythonHooks
    from loom_hops._saved_hooks import HookPair

    def halve_pack(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def forgetful_unpack(p: torch.Tensor) -> torch.Tensor:
        return p  # stays bf16: refused

    hooks = TracedPythonHooks(HookPair(halve_pack, forgetful_unpack))
    saved = torch.randn(4, 3)
    pack = hooks.trace_pack(saved)
    assert not isinstance(pack, loom_hops.Unsupported)
    refusal = hooks.trace_unpack(pack, saved)
    assert isinstance(refusal, loom_hops.Unsupported)
    assert refusal.kind is loom_hops.HopsRefusalKind.UNPACK_MISMATCH
    assert "forgetful_unpack" in refusal.where and "test_python_hooks.py" in refusal.where
    assert "call_pure" not in refusal.where and "_Traced" not in refusal.where
