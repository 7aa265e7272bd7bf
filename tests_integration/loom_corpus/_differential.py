"""The differential runner: one program, eager against a compiled copy.

:func:`run_differential` builds the program twice from the same seed, runs one
copy eagerly and the other through ``torch.compile`` for every call, and after
each call compares, with the program's per-dtype tolerances: the outputs (and
whether they require grad and which inputs they alias), every tensor input
(mutations), the module's buffers and parameters (BatchNorm running stats),
and, for training programs, every parameter gradient and input gradient after
backpropagating the same weighted sum of the outputs on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._program import Case, Program

__all__ = ["DifferentialResult", "compile_copy", "run_differential"]


@dataclasses.dataclass(frozen=True, slots=True)
class DifferentialResult:
    """What one differential run checked (for assertions beyond equality)."""

    program: str
    calls: int
    compared_tensors: int
    unique_graphs: int


def _flatten(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key in value:
            yield from _flatten(value[key], f"{path}[{key!r}]")
    else:
        yield path, value


def _storage_key(t: torch.Tensor) -> int | None:
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


class _Comparer:
    def __init__(self, program: Program) -> None:
        self.program = program
        self.count = 0

    def tensors(self, where: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} compiled vs {tuple(expected.shape)} eager"
        )
        assert actual.dtype == expected.dtype, (
            f"{where}: dtype {actual.dtype} compiled vs {expected.dtype} eager"
        )
        tol = self.program.tolerance(expected.dtype)
        torch.testing.assert_close(
            actual.detach(),
            expected.detach(),
            atol=tol.atol,
            rtol=tol.rtol,
            equal_nan=True,
            check_device=True,
            msg=lambda m: f"{self.program.name}: {where} differs from eager\n{m}",
        )
        self.count += 1

    def values(self, where: str, expected: Any, actual: Any) -> None:
        if isinstance(expected, torch.Tensor):
            assert isinstance(actual, torch.Tensor), f"{where}: compiled gave {type(actual)}"
            self.tensors(where, expected, actual)
        else:
            assert type(actual) is type(expected) and actual == expected, (
                f"{where}: compiled gave {actual!r}, eager {expected!r}"
            )


def _set_seed(program: Program, call: int) -> None:
    if program.seeded:
        torch.manual_seed(10_000 + call)


def _build(program: Program, device: torch.device) -> Case:
    torch.manual_seed(0)
    case = program.build(device, program.dtype)
    if isinstance(case.fn, nn.Module):
        case.fn.train(program.train)
    return case


def _loss(outputs: Sequence[tuple[str, Any]]) -> torch.Tensor | None:
    """The same weighted sum of every differentiable output on both sides."""
    total: torch.Tensor | None = None
    for i, (_, out) in enumerate(outputs):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            g = torch.Generator().manual_seed(777 + i)
            weight = torch.randn(out.shape, generator=g).to(out.device)
            term = (out.float() * weight).sum()
            total = term if total is None else total + term
    return total


def _params(fn: Callable[..., Any]) -> Mapping[str, torch.Tensor]:
    return dict(fn.named_parameters()) if isinstance(fn, nn.Module) else {}


def _buffers(fn: Callable[..., Any]) -> Mapping[str, torch.Tensor]:
    return dict(fn.named_buffers()) if isinstance(fn, nn.Module) else {}


def _alias_map(outs: Sequence[tuple[str, Any]], inputs: Sequence[Any]) -> list[tuple[int, ...]]:
    """For each tensor output, the indices of tensor inputs sharing its storage."""
    keys = [_storage_key(x) if isinstance(x, torch.Tensor) else None for x in inputs]
    result = []
    for _, out in outs:
        if isinstance(out, torch.Tensor):
            key = _storage_key(out)
            result.append(tuple(i for i, k in enumerate(keys) if key is not None and k == key))
    return result


Backend = str | Callable[..., Any]


def compile_copy(
    fn: Callable[..., Any],
    backend: Backend,
    options: Mapping[str, Any] | None,
    dynamic: bool | None,
) -> Callable[..., Any]:
    """``torch.compile`` one copy; options go only to backends that take them."""
    if backend in ("loom", "inductor"):
        return torch.compile(fn, backend=backend, options=dict(options or {}), dynamic=dynamic)
    assert not options, f"backend {backend!r} takes no options, got {options}"
    return torch.compile(fn, backend=backend, dynamic=dynamic)


def run_differential(
    program: Program,
    backend: Backend = "loom",
    options: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> DifferentialResult:
    """Run ``program`` eagerly and compiled for ``program.calls`` calls; assert equal.

    Raises ``AssertionError`` naming the program, the call and what differed
    (``output[1]``, ``input 0 after the call``, ``grad of fc.weight``, ...).
    """
    from torch._dynamo.utils import counters

    device = torch.device(device)
    graphs_before = int(counters["stats"]["unique_graphs"])
    eager = _build(program, device)
    compiled_case = _build(program, device)
    cmp = _Comparer(program)
    for name, p in _params(eager.fn).items():
        cmp.tensors(f"initial parameter {name}", p, _params(compiled_case.fn)[name])
    compiled = compile_copy(compiled_case.fn, backend, options, program.dynamic)

    # NOTE: fallback_random makes Inductor draw random numbers through aten, in
    # eager's order, so seeded dropout matches; it is a no-op for eager codegen.
    with _inductor_random_matches_eager(program.seeded):
        for call in range(program.calls):
            _one_call(program, call, device, eager, compiled_case, compiled, cmp)
    graphs = int(counters["stats"]["unique_graphs"]) - graphs_before
    assert graphs >= 1 or program.expected_graphs == 0, (
        f"{program.name}: Dynamo compiled no graph, so nothing compiled was compared"
    )
    if program.expected_graphs is not None:
        assert graphs == program.expected_graphs, (
            f"{program.name}: Dynamo compiled {graphs} graphs over {program.calls} calls, "
            f"expected {program.expected_graphs} (graph breaks and recompiles)"
        )
    return DifferentialResult(program.name, program.calls, cmp.count, graphs)


@contextlib.contextmanager
def _inductor_random_matches_eager(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):
        yield


def _one_call(
    program: Program,
    call: int,
    device: torch.device,
    eager: Case,
    compiled_case: Case,
    compiled: Callable[..., Any],
    cmp: _Comparer,
) -> None:
    at = f"call {call}"
    args_e = eager.inputs(call)
    args_c = compiled_case.inputs(call)
    for i, (a, b) in enumerate(zip(args_e, args_c, strict=True)):
        cmp.values(f"{at}: input {i} before the call (factory not deterministic?)", a, b)
    if not program.accumulate_grads:
        for p in (*_params(eager.fn).values(), *_params(compiled_case.fn).values()):
            p.grad = None

    _set_seed(program, call)
    with program.context(device):
        out_e = eager.fn(*args_e)
    _set_seed(program, call)
    with program.context(device):
        out_c = compiled(*args_c)

    flat_e = list(_flatten(out_e, "output"))
    flat_c = list(_flatten(out_c, "output"))
    assert [p for p, _ in flat_c] == [p for p, _ in flat_e], (
        f"{program.name} {at}: output structure {[p for p, _ in flat_c]} compiled "
        f"vs {[p for p, _ in flat_e]} eager"
    )
    for (where, e), (_, c) in zip(flat_e, flat_c, strict=True):
        cmp.values(f"{at}: {where}", e, c)
        if isinstance(e, torch.Tensor):
            assert c.requires_grad == e.requires_grad, (
                f"{program.name} {at}: {where}.requires_grad is {c.requires_grad} compiled, "
                f"{e.requires_grad} eager"
            )
    assert _alias_map(flat_c, args_c) == _alias_map(flat_e, args_e), (
        f"{program.name} {at}: outputs alias inputs {_alias_map(flat_c, args_c)} compiled "
        f"vs {_alias_map(flat_e, args_e)} eager (per output: indices of aliased inputs)"
    )

    if program.train:
        loss_e, loss_c = _loss(flat_e), _loss(flat_c)
        assert loss_e is not None, f"{program.name}: train program has no differentiable output"
        assert loss_c is not None, f"{program.name} {at}: compiled outputs lost requires_grad"
        loss_e.backward()
        loss_c.backward()

    for i, (a, b) in enumerate(zip(args_e, args_c, strict=True)):
        if isinstance(a, torch.Tensor):
            cmp.tensors(f"{at}: input {i} after the call", a, b)
            if program.train and a.is_leaf and a.requires_grad:
                _grads(cmp, f"{at}: grad of input {i}", a.grad, b.grad)
    params_c = _params(compiled_case.fn)
    for name, p in _params(eager.fn).items():
        cmp.tensors(f"{at}: parameter {name}", p, params_c[name])
        if program.train:
            _grads(cmp, f"{at}: grad of {name}", p.grad, params_c[name].grad)
    buffers_c = _buffers(compiled_case.fn)
    for name, b in _buffers(eager.fn).items():
        cmp.tensors(f"{at}: buffer {name}", b, buffers_c[name])


def _grads(
    cmp: _Comparer, where: str, expected: torch.Tensor | None, actual: torch.Tensor | None
) -> None:
    assert (actual is None) == (expected is None), (
        f"{cmp.program.name} {where}: compiled grad is {'None' if actual is None else 'set'}, "
        f"eager grad is {'None' if expected is None else 'set'}"
    )
    if expected is not None and actual is not None:
        cmp.tensors(where, expected, actual)
