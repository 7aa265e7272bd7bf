"""Activation offload under ``loom``: offload pairs lowered to overlapped copies (GPU),
and hooks that stay eager run as eager runs them (CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import loom_offload
import torchloom


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x).tanh()
        return x


def _step(
    model: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.nn.Parameter],
    x: torch.Tensor,
    hooks: Callable[[], Any],
) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    with hooks():
        loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in params if p.grad is not None]


def _offload_entries() -> list[str]:
    return [line for line in str(torchloom.report()).splitlines() if "[offload]" in line]


_SMALL = {
    "offload_min_bytes": 0,
    "offload_window_bytes": 1 << 20,
    "offload_prefetch_bytes": 1 << 20,
}


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_save_on_cpu_is_lowered_and_bitwise_equal_to_its_own_copies(codegen: str) -> None:
    torch.manual_seed(0)
    model = Block(256).cuda()
    params = list(model.parameters())
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    hooks = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    eager = _step(model, params, x, hooks)
    torch._dynamo.reset()
    plain = torch.compile(model, backend="loom", options={"codegen": codegen, "offload": False})
    want = _step(plain, params, x, hooks)
    torch._dynamo.reset()
    lowered = torch.compile(model, backend="loom", options={"codegen": codegen, **_SMALL})
    before = loom_offload.transfers_for(torch.device("cuda")).stats()
    got = _step(lowered, params, x, hooks)
    after = loom_offload.transfers_for(torch.device("cuda")).stats()
    assert after.offloaded > before.offloaded and after.reloaded > before.reloaded
    assert any("lowered" in e for e in _offload_entries())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_reload_waits_for_its_copy_behind_a_slow_transfer() -> None:
    """A slow kernel queued on the transfer stream delays every copy: a reload read
    before its copy completed would give other gradients."""
    torch.manual_seed(0)
    model = Block(256).cuda()
    params = list(model.parameters())
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    hooks = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    torch._dynamo.reset()
    lowered = torch.compile(model, backend="loom", options=_SMALL)
    want = _step(lowered, params, x, hooks)
    transfers = loom_offload.transfers_for(torch.device("cuda"))
    assert transfers.stream is not None
    for _ in range(3):
        with torch.cuda.stream(transfers.stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s on the transfer stream
        got = _step(lowered, params, x, hooks)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
def test_host_blocks_are_reused_and_nothing_grows_over_100_steps() -> None:
    torch.manual_seed(0)
    model = Block(256).cuda()
    params = list(model.parameters())
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    hooks = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    torch._dynamo.reset()
    lowered = torch.compile(model, backend="loom", options=_SMALL)
    for _ in range(3):
        _step(lowered, params, x, hooks)
    torch.cuda.synchronize()
    pool = loom_offload.pool_stats()["cuda:0"]
    allocated = torch.cuda.memory_allocated()
    for _ in range(100):
        _step(lowered, params, x, hooks)
    torch.cuda.synchronize()
    later = loom_offload.pool_stats()["cuda:0"]
    assert later.blocks == pool.blocks and later.bytes == pool.bytes
    assert later.reused >= pool.reused + 100
    assert torch.cuda.memory_allocated() == allocated


@pytest.mark.inductor
def test_refused_pack_that_drops_strides_runs_as_eager_under_inductor() -> None:
    """Issue 45: a pack loom refuses (it reads the clock) and that returns contiguous
    copies (as ``save_on_cpu``'s ``torch.empty(t.size())`` does) ran eagerly on the
    compiled function's saved tensors, and Inductor's backward asserted their strides."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    stamps: list[float] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        stamps.append(time.monotonic())
        out = torch.empty(t.size(), dtype=t.dtype)
        out.copy_(t)
        return out

    def run(m: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = run(model)
    torch._dynamo.reset()
    got_loss, got = run(torch.compile(model, backend="loom"))
    torch.testing.assert_close(got_loss, loss)
    for g, w in zip(got, grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert any("stay eager" in line for line in str(torchloom.report()).splitlines())
