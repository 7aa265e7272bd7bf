"""The corpus, eager against ``backend="loom"``: outputs, mutated inputs, buffers, gradients.

CPU runs every program with ``codegen="eager"`` (AOTAutograd and the loom
pipeline, no Inductor codegen) and a few with Inductor (``inductor`` marker);
the ``gpu`` marker runs every program on CUDA with the default options.
``LOOM_CORPUS_BACKEND=aot_eager`` runs the same comparisons against PyTorch's
own ``aot_eager``/``inductor`` backends, to tell a loom bug from a corpus bug.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from loom_corpus import PROGRAMS, Program, by_name, run_differential

BACKEND = os.environ.get("LOOM_CORPUS_BACKEND", "loom")
INDUCTOR_ON_CPU = (
    "mlp_train",
    "conv_bn_train",
    "mutate_input_views",
    "dropout_seeded_train",
)


def _backend(codegen: str) -> tuple[str, Mapping[str, Any] | None]:
    if BACKEND == "loom":
        return "loom", ({"codegen": "eager"} if codegen == "eager" else {})
    return (BACKEND, None) if codegen == "eager" else ("inductor", {})


def _check_loom_compiled_every_graph(backend: str, graphs: int) -> None:
    """A graph that fell back to eager would pass the comparison trivially."""
    if backend != "loom":
        return
    import torchloom

    report = torchloom.report()
    assert len(report) == graphs, report.format()
    fallbacks = [f"graph {g.graph_id}: {g.fallback}" for g in report if g.fallback]
    assert not fallbacks, "loom fell back to eager:\n" + "\n".join(fallbacks)


def _ids(programs: tuple[Program, ...]) -> list[Any]:
    return [pytest.param(p, id=p.name) for p in programs]


@pytest.mark.parametrize("program", _ids(PROGRAMS))
def test_program_matches_eager_on_cpu(program: Program) -> None:
    backend, options = _backend("eager")
    result = run_differential(program, backend, options, "cpu")
    assert result.compared_tensors > 0
    _check_loom_compiled_every_graph(backend, result.unique_graphs)


@pytest.mark.inductor
@pytest.mark.parametrize("program", _ids(tuple(by_name(n) for n in INDUCTOR_ON_CPU)))
def test_program_matches_eager_on_cpu_with_inductor(program: Program) -> None:
    backend, options = _backend("inductor")
    result = run_differential(program, backend, options, "cpu")
    _check_loom_compiled_every_graph(backend, result.unique_graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("program", _ids(PROGRAMS))
def test_program_matches_eager_on_cuda_with_default_options(
    program: Program, cuda_without_tf32: torch.device
) -> None:
    backend, options = _backend("inductor")
    result = run_differential(program, backend, options, cuda_without_tf32)
    _check_loom_compiled_every_graph(backend, result.unique_graphs)


def test_corpus_has_at_least_25_programs_with_unique_names() -> None:
    names = [p.name for p in PROGRAMS]
    assert len(names) >= 25
    assert len(set(names)) == len(names)


# The runner must fail when a backend is wrong: each broken backend below
# breaks one guarantee and the runner must name it.


def _tensor_args(args: tuple[Any, ...], clone: bool) -> list[Any]:
    return [a.clone() if clone and isinstance(a, torch.Tensor) else a for a in args]


def _perturbs_outputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    def run(*args: Any) -> Any:
        return [
            o + 1e-2 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
            for o in gm(*args)
        ]

    return run


def _drops_mutations(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return lambda *args: gm(*_tensor_args(args, clone=True))


def _cuts_autograd(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    def run(*args: Any) -> Any:
        return [
            o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor) else o
            for o in gm(*args)
        ]

    return run


@pytest.mark.parametrize(
    "backend,program,message",
    [
        pytest.param(_perturbs_outputs, "mlp_inference", "output differs", id="outputs"),
        pytest.param(_drops_mutations, "mutate_input", "input 0 after the call", id="mutation"),
        pytest.param(_drops_mutations, "conv_bn_train", "buffer bn1.running_mean", id="buffers"),
        pytest.param(_cuts_autograd, "mlp_train", "compiled grad is None", id="gradients"),
    ],
)
def test_runner_reports_what_a_broken_backend_gets_wrong(
    backend: Any, program: str, message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        run_differential(by_name(program), backend, None, "cpu")


def test_runner_reports_an_unexpected_number_of_graphs() -> None:
    import dataclasses

    program = dataclasses.replace(by_name("graph_break_in_the_middle"), expected_graphs=1)
    backend, options = _backend("eager")
    with pytest.raises(AssertionError, match="compiled 2 graphs over 2 calls, expected 1"):
        run_differential(program, backend, options, "cpu")


def test_graph_break_in_the_middle_gives_two_compiled_graphs_in_the_report() -> None:
    import torchloom

    run_differential(by_name("graph_break_in_the_middle"), "loom", {"codegen": "eager"}, "cpu")
    report = torchloom.report()
    assert len(report) == 2, report.format()
    assert all(g.fallback is None for g in report), report.format()


@torch._dynamo.disable
def _double_outside_dynamo(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _calls_only_disabled_code(x: torch.Tensor) -> torch.Tensor:
    return _double_outside_dynamo(x)


def test_runner_reports_a_program_that_dynamo_does_not_compile() -> None:
    from loom_corpus import Case, gen, randn

    skipped = Program(
        "skipped_by_dynamo",
        lambda d, t: Case(_calls_only_disabled_code, lambda i: (randn(3, g=gen(i), device=d),)),
    )
    backend, options = _backend("eager")
    with pytest.raises(AssertionError, match="Dynamo compiled no graph"):
        run_differential(skipped, backend, options, "cpu")
