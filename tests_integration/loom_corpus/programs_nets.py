"""Whole networks: MLPs, convolutions with BatchNorm, transformer blocks, embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._program import Case, Program, Tolerance, gen, randint, randn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = torch.relu(self.fc2(x)) + x
        return self.fc3(x)


def build_mlp(device: torch.device, dtype: torch.dtype, *, grad_input: bool = False) -> Case:
    model = MLP().to(device=device, dtype=dtype)
    return Case(
        model,
        lambda i: (randn(8, 32, g=gen(i), device=device, dtype=dtype, requires_grad=grad_input),),
    )


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)) + x)
        return self.head(x.mean(dim=(2, 3)))


def build_conv_bn(device: torch.device, dtype: torch.dtype) -> Case:
    model = ConvBN().to(device=device, dtype=dtype)
    return Case(model, lambda i: (randn(4, 3, 12, 12, g=gen(i), device=device, dtype=dtype),))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, *, fused_attention: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.fused = fused_attention
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_block(device: torch.device, dtype: torch.dtype, *, fused: bool = True) -> Case:
    model = nn.Sequential(Block(fused_attention=fused), Block(fused_attention=fused))
    model = model.to(device=device, dtype=dtype)
    return Case(
        model,
        lambda i: (randn(2, 16, 32, g=gen(i), device=device, dtype=dtype, requires_grad=True),),
    )


class TinyLM(nn.Module):
    """Token embedding, LayerNorm, a tied output head and a cross-entropy loss."""

    def __init__(self, vocab: int = 50, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.ln(self.emb(tokens))
        logits = h @ self.emb.weight.t()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss, logits.argmax(dim=-1)


def build_tiny_lm(device: torch.device, dtype: torch.dtype) -> Case:
    model = TinyLM().to(device=device, dtype=dtype)
    return Case(
        model,
        lambda i: (
            randint(50, 4, 10, g=gen(i), device=device),
            randint(50, 4, 10, g=gen(100 + i), device=device),
        ),
    )


def build_bn1d(device: torch.device, dtype: torch.dtype) -> Case:
    # NOTE: not momentum=None: its float(num_batches_tracked) breaks the graph
    # on .item() and Dynamo then compiles nothing of this module.
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12, momentum=0.3), nn.Tanh())
    model = model.to(device=device, dtype=dtype)
    return Case(model, lambda i: (randn(16, 6, g=gen(i), device=device, dtype=dtype),))


PROGRAMS: tuple[Program, ...] = (
    Program("mlp_inference", build_mlp, description="batch-8 MLP, eval, no grad"),
    Program(
        "mlp_train",
        lambda d, t: build_mlp(d, t, grad_input=True),
        train=True,
        calls=3,
        description="MLP training step, parameter and input grads",
    ),
    Program(
        "mlp_train_bf16",
        lambda d, t: build_mlp(d, t, grad_input=True),
        train=True,
        dtype=torch.bfloat16,
        tolerances={torch.bfloat16: Tolerance(6e-2, 6e-2)},
        description="MLP training in bfloat16 parameters and activations",
    ),
    Program(
        "conv_bn_train",
        build_conv_bn,
        train=True,
        calls=3,
        description="conv + BatchNorm2d in train mode: running stats updated in forward",
    ),
    Program("conv_bn_eval", build_conv_bn, description="conv + BatchNorm2d in eval mode"),
    Program(
        "transformer_block_train",
        build_block,
        train=True,
        description="two pre-norm blocks, SDPA causal attention, training",
    ),
    Program(
        "transformer_block_manual_attention",
        lambda d, t: build_block(d, t, fused=False),
        train=True,
        description="two blocks with masked softmax attention written out",
    ),
    Program(
        "embedding_cross_entropy",
        build_tiny_lm,
        train=True,
        description="int64 token ids, tied embedding, loss and argmax outputs",
    ),
    Program(
        "batchnorm1d_running_stats",
        build_bn1d,
        train=True,
        calls=3,
        description="BatchNorm1d in train mode: running stats and num_batches_tracked",
    ),
)
