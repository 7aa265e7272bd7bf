"""Dynamo's DDP optimizer calls each bucket's compiled graph once on fake tensors.

``torch.compile(DDP(model), backend="loom")`` splits the frame at DDP's bucket
boundaries; for each piece compiled through AOTAutograd the optimizer sets
``TracingContext.fakify_first_call`` and calls the compiled piece on fake
tensors to get the next piece's inputs. A cold compile answers through
AOTAutograd's ``FakifiedOutWrapper``; a piece served from loom's cache (the
second and third of three identical buckets, in the very first run) ran its
compiled code on the fake tensors: Inductor's kernels failed ("Cannot access data
pointer of Tensor" on CUDA), CUDA-graph segments recorded fake tensors. These
tests use one gloo rank and eager codegen, and assert that no compiled code,
capture or pack side effect sees the fake call.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import loom_cudagraph
import torchloom
from torchloom import Pipeline
from torchloom._output_code import EagerOutputCode

EAGER = {"codegen": "eager"}
WIDTH = 512  # each Linear just over 1 MiB: a bucket of its own at bucket_cap_mb=1


class _Layers(torch.nn.Module):
    # NOTE: a module of the user's own (an nn.Sequential's forward is skipped by Dynamo).
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHLOOM_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("TORCHLOOM_CACHE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    torchloom.reset()
    yield
    torchloom.reset()
    torch._dynamo.reset()
    dist.destroy_process_group()


@pytest.fixture
def fake_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of loom's eager compiled code that received a fake tensor."""
    seen: list[str] = []
    call = EagerOutputCode.__call__

    def recording(self: EagerOutputCode, inputs: Any) -> Any:
        if any(isinstance(t, FakeTensor) for t in inputs):
            seen.append("EagerOutputCode")
        return call(self, inputs)

    monkeypatch.setattr(EagerOutputCode, "__call__", recording)
    return seen


def _train(
    backend: Any = "loom",
    options: dict[str, Any] | None = None,
    *,
    ddp: str = "outer",
    hooks: tuple[Any, Any] | None = None,
    steps: int = 2,
) -> tuple[list[float], list[torch.Tensor]]:
    """``steps`` SGD steps of a fresh DDP model (one gloo rank): losses, parameters.

    ``ddp``: ``"outer"`` compiles ``DDP(model)``, ``"inner"`` wraps the compiled model
    in DDP, ``"eager"`` compiles nothing.
    """
    torch._dynamo.reset()
    torchloom.reset()
    torch.manual_seed(0)
    model = _Layers()
    kwargs = {"backend": backend, "options": options if options is not None else EAGER}
    inner = torch.compile(model, **kwargs) if ddp == "inner" else model
    wrapped = DDP(inner, bucket_cap_mb=1)
    run = torch.compile(wrapped, **kwargs) if ddp == "outer" else wrapped
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, WIDTH, generator=gen)
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                loss = run(x).square().mean()
        else:
            loss = run(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def _same(
    a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]
) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _cache_kinds() -> list[str]:
    return [e.kind for e in torchloom.report().entries("cache")]


@pytest.mark.parametrize("ddp", ["outer", "inner"])
def test_buckets_served_from_the_cache_never_run_compiled_code_on_fake_tensors(
    fake_calls: list[str], ddp: str
) -> None:
    eager = _train(ddp="eager")
    cold = _train(ddp=ddp)
    # the last two buckets are the same graph: the third hits the second's entry, in
    # this very run (the first bucket's input needs no gradient, a graph of its own)
    assert len(torchloom.report()) == 3
    assert _cache_kinds() == ["miss", "stored", "miss", "stored", "hit"]
    warm = _train(ddp=ddp)
    assert _cache_kinds() == ["hit"] * 3
    assert fake_calls == []
    _same(cold, eager)
    _same(warm, eager)


def test_cache_off_and_cold_compiles_answer_the_fake_call_without_running(
    fake_calls: list[str],
) -> None:
    eager = _train(ddp="eager")
    _same(_train(options={**EAGER, "cache": False}), eager)
    assert len(torchloom.report()) == 3 and _cache_kinds() == ["bypass"] * 3
    assert fake_calls == []


class _FakeRefusingCapturer(loom_cudagraph.HostCapturer):
    """A host capturer that records any capture or replay handed a fake tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fake: list[str] = []

    def capture(self, fn: Any, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        if any(isinstance(t, FakeTensor) for t in inputs):
            self.fake.append("capture")
        return super().capture(fn, inputs, pool)


def test_cudagraph_segments_served_under_ddp_record_nothing_on_fake_tensors() -> None:
    eager = _train(ddp="eager", steps=3)
    options = {**EAGER, "cudagraphs": True}
    capturer = _FakeRefusingCapturer()
    cold = _train(Pipeline(capturer=capturer, cudagraph_device="cpu"), options, steps=3)
    assert "hit" in _cache_kinds()
    recordings_cold = capturer.captures
    warm = _train(Pipeline(capturer=capturer, cudagraph_device="cpu"), options, steps=3)
    assert _cache_kinds() == ["hit"] * 3
    assert capturer.fake == []
    # a served run records as many graphs as the cold run did: the fake call counted none
    assert capturer.captures == 2 * recordings_cold > 0
    _same(cold, eager)
    _same(warm, eager)


def test_in_graph_saved_tensor_hooks_replay_pack_effects_only_for_real_calls() -> None:
    def hooks(count: dict[str, int]) -> tuple[Any, Any]:
        def pack(t: torch.Tensor) -> Any:
            count["pack"] += 1
            return (t.dtype, t.to(torch.bfloat16))

        def unpack(p: Any) -> torch.Tensor:
            return p[1].to(p[0])

        return pack, unpack

    want = {"pack": 0}
    eager = _train(ddp="eager", hooks=hooks(want))
    for options in (EAGER, {**EAGER, "cache": False}):
        got = {"pack": 0}
        _same(_train(options=options, hooks=hooks(got)), eager)
        assert any(e.kind == "placed" for e in torchloom.report().entries("hooks"))
        assert got == want
