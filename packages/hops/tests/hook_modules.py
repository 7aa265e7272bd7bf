"""Saved-tensor hook pairs as GraphModules, shared by the tests (and their eager twins)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

FP8_MAX = 448.0


class Bf16Pack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (x.dtype, x.to(torch.bfloat16))


class CastUnpack(torch.nn.Module):
    def forward(self, packed: Any) -> torch.Tensor:
        return packed[1].to(packed[0])


class Fp8Pack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        scale = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
        return (x.dtype, (x / scale).to(torch.float8_e4m3fn), scale)


class Fp8Unpack(torch.nn.Module):
    def forward(self, packed: Any) -> torch.Tensor:
        dtype, q, scale = packed
        return (q.to(torch.float32) * scale).to(dtype)


class OffloadPack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (x.device, x.to("cpu"))


class OffloadUnpack(torch.nn.Module):
    def forward(self, packed: Any) -> torch.Tensor:
        return packed[1].to(packed[0])


class IdentityPack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1


class IdentityUnpack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@torch.fx.wrap
def quantize_big_float32(x: torch.Tensor) -> Any:
    """A per-tensor decision: only float32 tensors above 64 elements go to bf16."""
    if x.dtype == torch.float32 and x.numel() > 64:
        return (x.dtype, x.to(torch.bfloat16))
    return (x.dtype, x)


class DecidingPack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return quantize_big_float32(x)


def pair(pack: torch.nn.Module, unpack: torch.nn.Module) -> tuple[Any, Any]:
    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)


def bf16() -> tuple[Any, Any]:
    return pair(Bf16Pack(), CastUnpack())


def fp8() -> tuple[Any, Any]:
    return pair(Fp8Pack(), Fp8Unpack())


def offload() -> tuple[Any, Any]:
    return pair(OffloadPack(), OffloadUnpack())


def deciding() -> tuple[Any, Any]:
    pack = torch.fx.symbolic_trace(DecidingPack())
    for node in pack.graph.nodes:
        if node.target is quantize_big_float32:
            node.meta["user_cache_hash"] = "quantize_big_float32-v1"
    return pack, torch.fx.symbolic_trace(CastUnpack())


class FlatPack(torch.nn.Module):
    """Packs a flat bf16 copy and the sizes needed to restore it (SymInts when dynamic)."""

    def forward(self, x: torch.Tensor) -> Any:
        return (x.shape, x.dtype, x.flatten().to(torch.bfloat16))


class FlatUnpack(torch.nn.Module):
    def forward(self, packed: Any) -> torch.Tensor:
        shape, dtype, flat = packed
        return flat.to(dtype).view(shape)


def flat() -> tuple[Any, Any]:
    return pair(FlatPack(), FlatUnpack())
