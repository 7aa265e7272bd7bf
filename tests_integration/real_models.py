"""Real models built from configs with random weights, and one runner for their steps.

A :class:`RealModel` is a Hugging Face or torchvision model built from a config
class (never downloaded: ``transformers`` is imported by the builders, after
the test module has set ``HF_HUB_OFFLINE``), the inputs of each step and the
function that turns a batch into ``(loss, logits)``. :func:`run_steps` runs a
few steps of one model on one side (eager, or ``torch.compile`` with some
backend) and records what each step produced: the loss and logits, every
parameter gradient, and the parameters and buffers after the optimizer step.
:func:`differential` runs eager, a PyTorch reference backend and ``loom`` on
the same steps and asserts that both compiled sides match eager and that
``loom`` compiled exactly the graphs the reference did: the same graph
breaks, no extra recompile, no graph that fell back to eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BERT",
    "GPT2",
    "LLAMA",
    "MODELS",
    "RESNET",
    "Backend",
    "Compiles",
    "LoomCompiledOtherwise",
    "LoomFellBack",
    "RealModel",
    "Run",
    "Setup",
    "Tolerance",
    "assert_same_steps",
    "build_gpt2",
    "build_llama",
    "differential",
    "enable_checkpointing",
    "run_steps",
]

Batch = dict[str, torch.Tensor]
Forward = Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]


# -- the models -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RealModel:
    """A model family: how to build it, feed it and train it.

    ``build()`` makes the model on CPU in float32 (the runner seeds first);
    ``batch(step, size, device)`` the inputs of one step, deterministic in
    ``step`` (``size`` is the sequence length of a text model, the batch size
    of an image model); ``forward(model, batch) -> (loss, logits)`` is the
    function that is compiled; ``sizes`` the default size and a second one
    (``dynamic=True`` tests).
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, torch.device], Batch]
    forward: Forward
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    sizes: tuple[int, int]


VOCAB = 128


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000 + step)


def build_llama(layers: int = 2, hidden: int = 64, heads: int = 4) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _token_batch(step: int, seq: int, device: torch.device) -> Batch:
    ids = torch.randint(0, VOCAB, (2, seq), generator=_gen(step))
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def causal_lm_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    return out.loss, out.logits


def build_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(config)


def build_bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=3,
        attn_implementation="sdpa",
    )
    return transformers.BertForSequenceClassification(config)


def _padded_batch(step: int, seq: int, device: torch.device) -> Batch:
    g = _gen(step)
    ids = torch.randint(1, VOCAB, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq - seq // 4 :] = 0  # the second sequence is padded
    labels = torch.randint(0, 3, (2,), generator=g)
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


def classifier_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(**batch)
    return out.loss, out.logits


def build_resnet() -> nn.Module:
    # NOTE: torchvision is published some weeks after a torch release; on the newest
    # torch (the ``newest`` nox session) it may not exist yet: the test skips, saying so.
    torchvision = pytest.importorskip(
        "torchvision",
        reason=f"no torchvision is installed for torch {torch.__version__} (none published yet)",
    )

    return torchvision.models.resnet18(num_classes=10)


def _image_batch(step: int, batch: int, device: torch.device) -> Batch:
    g = _gen(step)
    images = torch.randn(batch, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return {"pixel_values": images.to(device), "labels": labels.to(device)}


def image_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["pixel_values"])
    return F.cross_entropy(logits, batch["labels"]), logits


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


LLAMA = RealModel("llama", build_llama, _token_batch, causal_lm_loss, _adamw, (16, 12))
#: Not in MODELS (the hooks and checkpointing tests use it beside Llama).
GPT2 = RealModel("gpt2", build_gpt2, _token_batch, causal_lm_loss, _adamw, (16, 12))
BERT = RealModel("bert", build_bert, _padded_batch, classifier_loss, _sgd, (16, 12))
# NOTE: batch 4 at least: at batch 2 layer4's BatchNorm normalizes two values per
# channel (1x1 maps) and the training diverges within three steps.
RESNET = RealModel("resnet18", build_resnet, _image_batch, image_loss, _sgd, (4, 2))
MODELS = (LLAMA, BERT, RESNET)


def enable_checkpointing(model: nn.Module) -> None:
    """Hugging Face activation checkpointing, non-reentrant (the name changed in 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class LoomFellBack(AssertionError):
    """``loom`` handed a graph back to eager (a graph it should have compiled)."""


class LoomCompiledOtherwise(AssertionError):
    """``loom`` compiled other frames, graphs or graph breaks than the reference."""


# -- one side's run ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """One compiled side: ``torch.compile`` keyword arguments (``backend``, ``options``, ``mode``)."""

    label: str
    kwargs: Mapping[str, Any]

    @property
    def is_loom(self) -> bool:
        return self.kwargs.get("backend") == "loom"

    def compile(self, fn: Forward, dynamic: bool | None) -> Forward:
        return torch.compile(fn, dynamic=dynamic, **self.kwargs)  # type: ignore[no-any-return]


def _no_context() -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _no_prepare(model: nn.Module) -> None:
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    """How one side runs its steps; each side gets its own (its own hook state).

    ``context()`` is entered around each step's forward and backward;
    ``prepare(model)`` runs once after the build (checkpointing, module hooks).
    ``sizes`` gives each step's size (default: the model's first size, twice).
    """

    train: bool = True
    sizes: tuple[int, ...] = ()
    dynamic: bool | None = None
    context: Callable[[], AbstractContextManager[Any]] = _no_context
    prepare: Callable[[nn.Module], None] = _no_prepare


@dataclasses.dataclass(frozen=True, slots=True)
class Compiles:
    """What Dynamo compiled during a run."""

    frames: int  # frames compiled, recompiles included
    graphs: int  # graphs handed to the backend
    graph_breaks: tuple[tuple[str, int], ...]  # reason -> count

    @staticmethod
    def since_reset() -> Compiles:
        from torch._dynamo.utils import counters

        breaks = tuple(sorted((str(k), int(v)) for k, v in counters["graph_break"].items()))
        return Compiles(
            int(counters["frames"]["ok"]), int(counters["stats"]["unique_graphs"]), breaks
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """What one side produced: per step, named values (detached copies)."""

    label: str
    steps: tuple[tuple[tuple[str, Any], ...], ...]
    compiles: Compiles | None


def _reset_compilers() -> None:
    from torch._dynamo.utils import counters

    import torchloom

    torch._dynamo.reset()
    counters.clear()
    torchloom.reset()


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def run_steps(
    model_spec: RealModel,
    backend: Backend | None,
    setup: Setup,
    device: torch.device | str = "cpu",
) -> Run:
    """Build the model and run ``setup``'s steps eagerly (``backend=None``) or compiled."""
    device = torch.device(device)
    if backend is not None:
        _reset_compilers()
    torch.manual_seed(0)
    model = model_spec.build().to(device).train(setup.train)
    setup.prepare(model)
    optimizer = model_spec.optimizer(model.parameters())
    forward = (
        model_spec.forward
        if backend is None
        else backend.compile(model_spec.forward, setup.dynamic)
    )
    sizes = setup.sizes or (model_spec.sizes[0],) * 2
    steps = []
    for step, size in enumerate(sizes):
        batch = model_spec.batch(step, size, device)
        # NOTE: a CUDA-graph side must not reuse the previous step's outputs (a no-op otherwise).
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        values: list[tuple[str, Any]] = []
        if setup.train:
            optimizer.zero_grad(set_to_none=True)
            with setup.context():
                loss, logits = forward(model, batch)
                values += [("loss", _snapshot(loss)), ("logits", _snapshot(logits))]
                loss.backward()
            values += [(f"grad of {n}", _grad(p)) for n, p in model.named_parameters()]
            optimizer.step()
            values += [(f"{n} after the step", _snapshot(p)) for n, p in model.named_parameters()]
        else:
            with setup.context(), torch.no_grad():
                loss, logits = forward(model, batch)
                values += [("loss", _snapshot(loss)), ("logits", _snapshot(logits))]
        values += [(f"buffer {n}", _snapshot(b)) for n, b in model.named_buffers()]
        steps.append(tuple(values))
    compiles = None if backend is None else Compiles.since_reset()
    if backend is not None and backend.is_loom:
        _check_loom_compiled_every_graph(backend, compiles)
    label = "eager" if backend is None else backend.label
    return Run(label, tuple(steps), compiles)


def _grad(p: nn.Parameter) -> torch.Tensor | None:
    return None if p.grad is None else _snapshot(p.grad)


def _check_loom_compiled_every_graph(backend: Backend, compiles: Compiles | None) -> None:
    """A graph that loom handed back to eager would match eager trivially."""
    import torchloom

    report = torchloom.report()
    # A graph Dynamo restarted (e.g. TensorifyScalarRestartAnalysis under dynamic=True) is
    # handed to the backend again: its first record says so and compiled nothing.
    restarted = {
        g.graph_id for g in report for e in g.entries if (e.area, e.kind) == ("pipeline", "restart")
    }
    compiled = [g for g in report if g.graph_id not in restarted]
    assert compiles is not None and len(compiled) == compiles.graphs, (
        f"{backend.label}: {len(compiled)} graphs in loom's report, Dynamo compiled "
        f"{compiles and compiles.graphs}\n{report.format()}"
    )
    fallbacks = [f"graph {g.graph_id}: {g.fallback}" for g in report if g.fallback]
    if fallbacks:
        raise LoomFellBack(f"{backend.label} fell back to eager:\n" + "\n".join(fallbacks))


# -- comparisons ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Tolerance:
    """Per-tensor bounds: ``assert_close(atol, rtol)``, or with ``rel_l2`` the relative
    L2 error ``|a - b| / |b|`` (for lossy saved-tensor hooks, bf16 or fp8)."""

    atol: float = 1e-4
    rtol: float = 1e-4
    rel_l2: float | None = None


def assert_same_steps(expected: Run, actual: Run, tol: Tolerance, what: str) -> int:
    """Assert every recorded value of ``actual`` matches ``expected``; returns how many."""
    assert len(actual.steps) == len(expected.steps)
    compared = 0
    for step, (want, got) in enumerate(zip(expected.steps, actual.steps, strict=True)):
        assert [k for k, _ in got] == [k for k, _ in want], f"{what}: step {step}: other values"
        for (key, a), (_, b) in zip(want, got, strict=True):
            where = f"{what}: step {step}: {key} ({actual.label} vs {expected.label})"
            assert (a is None) == (b is None), f"{where}: one of them is None"
            if a is not None:
                _assert_close(where, a, b, tol)
                compared += 1
    return compared


def _assert_close(where: str, want: torch.Tensor, got: torch.Tensor, tol: Tolerance) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{where}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    if tol.rel_l2 is None or not want.is_floating_point():
        torch.testing.assert_close(
            got, want, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{where} differs\n{m}"
        )
        return
    err = float((got.double() - want.double()).norm())
    ref = float(want.double().norm())
    assert err <= tol.rel_l2 * ref + tol.atol, (
        f"{where}: relative L2 error {err / max(ref, 1e-30):.3g}"
    )


def differential(
    model_spec: RealModel,
    setup: Callable[[str], Setup],
    loom: Backend,
    reference: Backend,
    device: torch.device | str = "cpu",
    tol: Tolerance = Tolerance(),
) -> dict[str, Run]:
    """Eager, ``reference`` and ``loom`` on the same steps; assert they agree.

    ``setup(label)`` gives each side its own :class:`Setup`. Both compiled
    sides must match eager within ``tol`` (a reference that does not is a
    PyTorch or model problem, and says so), and ``loom`` must have compiled
    the same frames and graphs with the same graph breaks as the reference.
    Returns the three runs by label.
    """
    eager = run_steps(model_spec, None, setup("eager"), device)
    ref = run_steps(model_spec, reference, setup(reference.label), device)
    got = run_steps(model_spec, loom, setup(loom.label), device)
    name = model_spec.name
    assert_same_steps(eager, ref, tol, f"{name} (the reference itself: not a loom bug)")
    assert assert_same_steps(eager, got, tol, name) > 0
    assert ref.compiles is not None and ref.compiles.graphs >= 1, (
        f"{name}: Dynamo compiled no graph under {reference.label}, nothing compiled was compared"
    )
    if got.compiles != ref.compiles:
        raise LoomCompiledOtherwise(
            f"{name}: {loom.label} compiled {got.compiles}, {reference.label} {ref.compiles}"
        )
    return {"eager": eager, reference.label: ref, loom.label: got}
