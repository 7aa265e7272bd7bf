"""Saved-tensor hooks where the device matters: checkpointed attention on each SDPA
backend, and values a hook reads at each call (a per-step scale) under CUDA graphs.

Every test runs twice: on CPU (eager codegen; CUDA graphs through the host
capturer, which replays a recording on its static inputs as a CUDA graph would)
and on CUDA (marker ``gpu``: Inductor codegen, real CUDA graphs). Each compares
the compiled steps with the same hooks in eager, step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import loom_cudagraph
import torchloom
from torchloom import Pipeline, cudagraph_stats

#: The CUDA cases: marker ``gpu``, skipped without CUDA.
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=ON_CUDA)]


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _entries(kind: str) -> list[torchloom.ReportEntry]:
    return [e for e in torchloom.report().entries("hooks") if e.kind == kind]


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - b.double()).norm() ** 2) for a, b in zip(got, want, strict=True))
    den = sum(float(b.double().norm() ** 2) for b in want)
    return (num / den) ** 0.5


def _step(
    fn: Any, model: nn.Module, xs: list[torch.Tensor], pairs: list[tuple[Any, Any]]
) -> list[torch.Tensor]:
    """One training step: a forward per input, each under its own pair, then one
    backward (gradient accumulation when there are several). Nothing the compiled
    function returned is held past the step."""
    model.zero_grad(set_to_none=True)
    loss: torch.Tensor | None = None
    outs = []
    for x, pair in zip(xs, pairs, strict=True):
        with torch.autograd.graph.saved_tensors_hooks(*pair):
            out = fn(x)
        outs.append(out.detach().clone())
        term = out.square().mean()
        loss = term if loss is None else loss + term
        del out
    assert loss is not None
    loss.backward()
    return [*outs, *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


# -- checkpointed attention on each SDPA backend ---------------------------------------

FP8 = torch.float8_e4m3fn


def delayed_fp8(scale: float) -> tuple[Any, Any]:
    """fp8 hooks with a per-step closure scale (delayed scaling): floating tensors of
    at least 1024 elements are stored as ``t * scale`` in fp8, others as they are."""

    def pack(t: torch.Tensor) -> Any:
        if not t.is_floating_point() or t.numel() < 1024:
            return (None, t)
        return (t.dtype, (t.float() * scale).clamp(-448.0, 448.0).to(FP8))

    def unpack(p: Any) -> torch.Tensor:
        dtype, q = p
        if dtype is None:
            return q  # type: ignore[no-any-return]
        return (q.float() / scale).to(dtype)  # type: ignore[no-any-return]

    return pack, unpack


class CheckpointedAttention(nn.Module):
    """Two pre-norm blocks; each block's attention (causal SDPA) runs under
    non-reentrant ``torch.utils.checkpoint``, its MLP does not."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return h + self.out(a.transpose(1, 2).reshape(b, s, w))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(self.attention, h, use_reentrant=False)
            h = h + self.down(nn.functional.silu(self.up(h)))
        return h


#: (device, SDPA backend, dtype, the aten op the forward graph must call or None for
#: the math backend, which decomposes). Flash needs half precision.
SDPA_CASES = [
    pytest.param("cpu", SDPBackend.MATH, torch.float32, None, id="cpu-math"),
    pytest.param(
        "cpu",
        SDPBackend.FLASH_ATTENTION,
        torch.float32,
        "_scaled_dot_product_flash_attention_for_cpu",
        id="cpu-flash",
    ),
    pytest.param(
        "cuda",
        SDPBackend.FLASH_ATTENTION,
        torch.bfloat16,
        "_scaled_dot_product_flash_attention",
        id="cuda-flash",
        marks=ON_CUDA,
    ),
    pytest.param(
        "cuda",
        SDPBackend.EFFICIENT_ATTENTION,
        torch.float32,
        "_scaled_dot_product_efficient_attention",
        id="cuda-efficient",
        marks=ON_CUDA,
    ),
    pytest.param("cuda", SDPBackend.MATH, torch.float32, None, id="cuda-math", marks=ON_CUDA),
]


def _compiled_attention(
    cls: type[nn.Module], device: str, dtype: torch.dtype, steps: int
) -> tuple[nn.Module, Any, list[torch.Tensor]]:
    """An attention model of this device's size, its loom compile (eager codegen on
    CPU, the defaults on CUDA) and ``steps`` inputs."""
    width, heads, batch, seq = (256, 4, 2, 128) if device == "cuda" else (64, 4, 2, 32)
    model = cls(width, heads).to(device=device, dtype=dtype)
    options = {"codegen": "eager"} if device == "cpu" else {}
    compiled = torch.compile(model, backend="loom", options=options)
    torch.manual_seed(1)
    xs = [torch.randn(batch, seq, width, device=device, dtype=dtype) for _ in range(steps)]
    return model, compiled, xs


def _tolerance(dtype: torch.dtype) -> float:
    return 0.1 if dtype == torch.bfloat16 else 6e-2


def _placed_in_one_compile() -> set[str]:
    """One frame compiled, the hooks placed with nothing refused or left eager; the
    reasons of the saved tensors the placement kept unpacked."""
    assert _frames() == 1, torchloom.report().format()
    (placed,) = _entries("placed")
    assert placed.get("packed") and not _entries("refused") and not _entries("eager")
    return set(dict(placed.get("kept") or ()).values())


@pytest.mark.parametrize(("device", "backend", "dtype", "op"), SDPA_CASES)
def test_checkpointed_sdpa_places_fp8_hooks_compiles_once_and_matches_eager(
    device: str, backend: SDPBackend, dtype: torch.dtype, op: str | None
) -> None:
    model, compiled, xs = _compiled_attention(CheckpointedAttention, device, dtype, 3)
    with sdpa_kernel([backend]):
        for step, x in enumerate(xs):
            pair = delayed_fp8(4.0 + step)  # a new pair and a new scale every step
            got = _step(compiled, model, [x], [pair])
            want = _step(model, model, [x], [pair])
            err = _rel_err(got, want)
            assert err < _tolerance(dtype), (step, err)
    kept = _placed_in_one_compile()
    assert "parameter read only inside checkpointed regions" in kept
    forward = "\n".join(
        code for g in torchloom.report() for kind, code in g.graphs if kind == "forward+hooks"
    )
    attention_ops = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if op is None:  # math: decomposed into matmuls and a softmax
        assert not any(name in forward for name in attention_ops), forward
    else:
        assert op in forward, forward


FP8_MAX = 448.0


def amax_fp8_pack(t: torch.Tensor) -> Any:
    """fp8 with a scale from the tensor's own amax, applied to *every* saved tensor,
    integer ones included (as a hook written without a dtype check does)."""
    scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (t.dtype, (t / scale).to(FP8), scale)


def amax_fp8_unpack(p: Any) -> torch.Tensor:
    dtype, q, scale = p
    return (q.to(torch.float32) * scale).to(dtype)  # type: ignore[no-any-return]


class Attention(CheckpointedAttention):
    """The same blocks without checkpointing: the attention op's own saved outputs
    (on CUDA its dropout seed and offset, CPU scalars at run time) reach the hooks."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            h = self.attention(h)
            h = h + self.down(nn.functional.silu(self.up(h)))
        return h


#: Flash attention's seed on CUDA is a uint64 CUDA tensor at run time (torch 2.11), which
#: the hook's ``abs`` refuses in eager too ("abs_cuda" not implemented for 'UInt64').
EVERY_SAVED_CASES = [c for c in SDPA_CASES if c.id != "cuda-flash"]


@pytest.mark.parametrize(("device", "backend", "dtype", "op"), EVERY_SAVED_CASES)
def test_hooks_that_pack_every_saved_tensor_run_with_the_attention_ops_seed_and_offset(
    device: str, backend: SDPBackend, dtype: torch.dtype, op: str | None
) -> None:
    # The CUDA attention ops save their philox seed and offset, whose fake device (the
    # query's) is not their run-time one (a CPU scalar): packed in the graph, Inductor
    # passed the CPU scalar to a Triton kernel ("CUDA driver error: invalid argument").
    model, compiled, xs = _compiled_attention(Attention, device, dtype, 2)
    pair = (amax_fp8_pack, amax_fp8_unpack)
    with sdpa_kernel([backend]):
        for x in xs:
            err = _rel_err(_step(compiled, model, [x], [pair]), _step(model, model, [x], [pair]))
            assert err < _tolerance(dtype), err
    kept = _placed_in_one_compile()
    seeds = "attention's dropout seed or offset (device known at run time)"
    assert (seeds in kept) == (op is not None and device == "cuda"), kept


# -- per-call hook values under CUDA graphs --------------------------------------------


def scaled_pair(scale: float, amax: torch.Tensor) -> tuple[Any, Any]:
    """A pair made anew each step over a closure float and a closure tensor: the saved
    tensor is stored times ``scale`` and given back times ``amax``, so each step's
    gradients show which values the compiled hooks read."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t * scale

    def unpack(p: torch.Tensor) -> torch.Tensor:
        return p * amax

    return pack, unpack


def _cudagraph_backend(device: str) -> tuple[Any, dict[str, Any], Callable[[], int]]:
    """The backend, its options, and a count of the captures made so far."""
    if device == "cpu":
        capturer = loom_cudagraph.HostCapturer()
        pipeline = Pipeline(capturer=capturer, cudagraph_device="cpu")
        return pipeline, {"codegen": "eager", "cudagraphs": True}, lambda: capturer.captures
    return "loom", {"cudagraphs": True}, lambda: _recordings()


def _segments() -> list[loom_cudagraph.SegmentStats]:
    return [s for r in cudagraph_stats() for s in r.segments]


def _recordings() -> int:
    return sum(s.recordings for s in _segments())


#: Relative L2 error allowed against eager: stale values are off by whole factors.
CG_TOL = {"cpu": 1e-5, "cuda": 1e-3}


def _mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_per_step_float_and_tensor_scales_under_cudagraphs_record_once(device: str) -> None:
    """A value constant for the first steps and then new every step: one compile, no
    recording after the first ones, and every replay reads its own step's values
    (a stale static buffer would give another step's gradients). A tensor reused
    while the value stays would be read in place and record again when it changes."""
    backend, options, captures = _cudagraph_backend(device)
    model = _mlp(device)
    compiled = torch.compile(model, backend=backend, options=options)
    x = torch.randn(32, 64, device=device)
    counts = []
    for step in range(10):
        scale, amax = (1.0, 1.0) if step < 4 else (1.0 + 0.5 * step, 2.0 + step)
        pair = scaled_pair(scale, torch.tensor(amax, device=device))
        got = _step(compiled, model, [x], [pair])
        want = _step(model, model, [x], [pair])
        assert _rel_err(got, want) < CG_TOL[device], step
        counts.append((_recordings(), captures()))
    assert _frames() == 1 and len(torchloom.report()) == 1
    assert _entries("placed") and not _entries("eager")
    segments = _segments()
    assert segments and all(s.captured for s in segments), torchloom.report().format()
    # warm-up at the first call, a recording at the second: none after the fourth
    assert counts[3][0] >= 1 and counts[-1] == counts[3], counts
    assert all(s.replays >= 6 for s in segments), [(s.name, s.replays) for s in segments]


@pytest.mark.parametrize("device", DEVICES)
def test_two_forwards_each_with_its_values_before_one_backward_under_cudagraphs(
    device: str,
) -> None:
    """Gradient accumulation with a scale per micro-batch: the values the first
    forward saved for the backward are its own, not the static buffer the second
    forward's replay refilled."""
    backend, options, _ = _cudagraph_backend(device)
    model = _mlp(device)
    compiled = torch.compile(model, backend=backend, options=options)
    torch.manual_seed(2)
    xs = [torch.randn(32, 64, device=device) for _ in range(2)]
    counts = []
    for step in range(8):
        pairs = [
            scaled_pair(1.0 + step + 0.25 * m, torch.tensor(3.0 - m + 0.5 * step, device=device))
            for m in range(2)
        ]
        got = _step(compiled, model, xs, pairs)
        want = _step(model, model, xs, pairs)
        assert _rel_err(got, want) < CG_TOL[device], step
        counts.append(_recordings())
    assert _frames() == 1
    assert _segments() and all(s.captured for s in _segments())
    assert counts[-1] == counts[len(counts) // 2], counts  # steady: no recording per step
