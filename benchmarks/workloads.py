"""The benchmark workloads: which model, which input, which step.

``workloads()``: the foundation models and their sizes come from
``torchloom._models`` (the same ones ``torchloom demo`` runs), so the demo and
the benchmarks measure the same shapes. ``hf_workloads()``: Hugging Face Llama
and GPT-2 decoders built from configs with random weights (nothing is
downloaded), a causal-LM training step and a batch-1 forward of a fixed window
(``bench_hf``'s two workloads). A :class:`Workload` builds a fresh model and
input on a device and gives the step to time: a training step (forward, a
scalar loss, backward, gradients cleared first) or an inference call under
``torch.no_grad``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchloom._models import MLP, GPTStack, ModelSize

__all__ = [
    "HF_GPU_SIZE",
    "HF_QUICK_SIZE",
    "QUICK_SIZE",
    "CausalLMLoss",
    "HFSize",
    "Workload",
    "build_gpt2",
    "build_llama",
    "find",
    "hf_size_for",
    "hf_workloads",
    "size_for",
    "step",
    "workloads",
]

#: ``--quick`` sizes: small enough for a CPU Inductor compile to take seconds.
QUICK_SIZE = ModelSize(width=64, depth=1, heads=4, seq=16, batch=8)


def size_for(device: torch.device, quick: bool) -> ModelSize:
    """The demo's size for ``device``, or :data:`QUICK_SIZE` for smoke runs."""
    return QUICK_SIZE if quick else ModelSize.for_device(device)


@dataclasses.dataclass(frozen=True, slots=True)
class HFSize:
    """A Hugging Face decoder's size and its two workloads' inputs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int  # training batch
    seq: int  # training sequence length
    window: int  # batch-1 forward length


HF_GPU_SIZE = HFSize(4, 512, 8, 4, 1408, 8192, batch=8, seq=256, window=32)
HF_QUICK_SIZE = HFSize(2, 64, 4, 2, 128, 128, batch=2, seq=16, window=8)


def hf_size_for(device: torch.device, quick: bool) -> HFSize:
    """:data:`HF_GPU_SIZE` on CUDA, :data:`HF_QUICK_SIZE` on CPU or for smoke runs."""
    return HF_QUICK_SIZE if quick or device.type != "cuda" else HF_GPU_SIZE


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """One measured workload: ``build`` returns a model and its input on a device.

    ``make_input`` gets the size and a seeded generator; ``sizes`` picks the size
    for a device (``make``)."""

    name: str
    train: bool
    build_model: Callable[[Any], nn.Module]
    make_input: Callable[[Any, torch.Generator], torch.Tensor]
    sizes: Callable[[torch.device, bool], Any] = size_for

    def build(self, size: Any, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = self.build_model(size).to(device).train(self.train)
        x = self.make_input(size, torch.Generator().manual_seed(1))
        return model, x.to(device)

    def make(self, device: torch.device, quick: bool) -> tuple[nn.Module, torch.Tensor]:
        """The model and input at this device's size (``--quick``: the small one)."""
        return self.build(self.sizes(device, quick), device)


def step(
    model: Callable[[torch.Tensor], torch.Tensor],
    params: list[nn.Parameter],
    x: torch.Tensor,
    train: bool,
) -> torch.Tensor:
    """One timed step; returns the output (detached for training steps)."""
    if not train:
        with torch.no_grad():
            return model(x)
    for p in params:
        p.grad = None
    out = model(x)
    # A model that returns its loss (a scalar) is trained on it.
    loss = out if out.ndim == 0 else out.float().pow(2).mean()
    torch.autograd.backward(loss)
    return out.detach()


def _randn(shape: Callable[[ModelSize], tuple[int, ...]]) -> Callable[..., torch.Tensor]:
    return lambda s, gen: torch.randn(shape(s), generator=gen)


def workloads() -> tuple[Workload, ...]:
    """Batch-8 MLP inference, MLP and GPT-stack training steps, batch-1 GPT inference."""
    return (
        Workload(
            "mlp_infer_b8",
            False,
            lambda s: MLP(s.width, s.depth * 2),
            _randn(lambda s: (8, s.width)),
        ),
        Workload(
            "mlp_train",
            True,
            lambda s: MLP(s.width, s.depth * 2),
            _randn(lambda s: (s.batch, s.width)),
        ),
        Workload(
            "gpt_train",
            True,
            lambda s: GPTStack(s.width, s.depth, s.heads),
            _randn(lambda s: (s.batch, s.seq, s.width)),
        ),
        Workload(
            "gpt_infer_b1",
            False,
            lambda s: GPTStack(s.width, s.depth, s.heads),
            _randn(lambda s: (1, s.seq, s.width)),
        ),
    )


# --- Hugging Face decoders -------------------------------------------------------------------


def build_llama(size: HFSize) -> nn.Module:
    """``LlamaForCausalLM`` from a config, random weights, SDPA attention, no KV cache."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(size.seq, size.window),
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def build_gpt2(size: HFSize) -> nn.Module:
    """``GPT2LMHeadModel`` from a config, random weights, SDPA attention, no dropout."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=size.vocab,
        n_embd=size.hidden,
        n_layer=size.layers,
        n_head=size.heads,
        n_inner=size.intermediate,
        n_positions=max(size.seq, size.window),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class CausalLMLoss(nn.Module):
    """A causal LM called with token ids alone, returning its cross-entropy loss on
    them (the labels are the inputs, shifted inside the model)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


class _Logits(nn.Module):
    """A causal LM's logits for a fixed window, no KV cache."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def _ids(shape: Callable[[HFSize], tuple[int, int]]) -> Callable[..., torch.Tensor]:
    return lambda s, gen: torch.randint(0, s.vocab, shape(s), generator=gen)


def hf_workloads() -> tuple[Workload, ...]:
    """Llama and GPT-2: a training step on their causal-LM loss, a batch-1 forward."""
    out = []
    for model, build in (("llama", build_llama), ("gpt2", build_gpt2)):
        out += [
            Workload(
                f"{model}_train",
                True,
                lambda s, b=build: CausalLMLoss(b(s)),
                _ids(lambda s: (s.batch, s.seq)),
                hf_size_for,
            ),
            Workload(
                f"{model}_infer_b1",
                False,
                lambda s, b=build: _Logits(b(s)),
                _ids(lambda s: (1, s.window)),
                hf_size_for,
            ),
        ]
    return tuple(out)


def find(name: str) -> Workload:
    """The workload of ``workloads()`` or ``hf_workloads()`` with this name."""
    for w in workloads() + hf_workloads():
        if w.name == name:
            return w
    raise KeyError(name)
