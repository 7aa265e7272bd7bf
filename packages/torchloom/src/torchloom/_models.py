"""Small reference models used by ``torchloom demo`` and the benchmarks.

A GPT-style block stack (pre-norm attention + MLP) and a plain MLP, sized by
one dataclass so CPU runs stay quick and GPU runs are launch-bound.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "GPTBlock", "GPTStack", "ModelSize"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSize:
    width: int = 256
    depth: int = 2
    heads: int = 4
    seq: int = 64
    batch: int = 8

    @staticmethod
    def for_device(device: torch.device) -> ModelSize:
        if device.type == "cuda":
            return ModelSize(width=1024, depth=4, heads=16, seq=256, batch=8)
        return ModelSize(width=128, depth=2, heads=4, seq=32, batch=8)


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        out: torch.Tensor = self.norm(x)
        return out


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        mlp: torch.Tensor = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + mlp


class GPTStack(nn.Module):
    def __init__(self, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.ln(x)
        return out
