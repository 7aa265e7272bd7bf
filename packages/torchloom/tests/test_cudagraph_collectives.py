"""Collectives under ``cudagraphs=True`` end to end on CPU: Dynamo's functional
collectives on a 1-rank gloo group, planned and captured with the ``HostCapturer``.

Gloo cannot be captured, and the real check says so in each skip; admitting gloo as
a capturable backend (what NCCL passes) shows the captured path: one segment,
outputs equal to eager. ``cudagraph_capture_collectives=False`` plans as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _train import train_like_eager

import loom_cudagraph
import loom_cudagraph._collectives as collectives_mod
import torchloom
from torchloom import Pipeline

CG = {"codegen": "eager", "cudagraphs": True}
WIDTH = 8


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[loom_cudagraph.HostCapturer]:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHLOOM_REMOTE_CACHE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    torchloom.reset()
    torch._dynamo.reset()
    loom_cudagraph.reset_skip_counts()
    yield loom_cudagraph.HostCapturer()
    torchloom.reset()
    torch._dynamo.reset()
    dist.destroy_process_group()


@pytest.fixture
def gloo_capturable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives_mod, "CAPTURABLE_BACKENDS", frozenset({"nccl", "gloo"}))


def layers(x: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
    """Two layers on weights all-gathered from shards, then an all-reduce."""
    group = dist.group.WORLD
    for shard in (s0, s1):
        w = funcol.all_gather_tensor(shard, 0, group)
        x = torch.tanh(x @ w.T)
    return funcol.all_reduce(x, "sum", group)


def _run(capturer: loom_cudagraph.HostCapturer, **options: Any) -> list[Any]:
    """Four calls against eager; the report's cudagraph entries."""
    backend = Pipeline(capturer=capturer, cudagraph_device="cpu")
    compiled = torch.compile(layers, backend=backend, options={**CG, **options})
    shards = [torch.randn(WIDTH, WIDTH) for _ in range(2)]
    for _ in range(4):
        x = torch.randn(3, WIDTH)
        torch.testing.assert_close(compiled(x, *shards), layers(x, *shards))
    return list(torchloom.report().entries("cudagraph"))


def _segments(entries: list[Any]) -> list[bool]:
    return [e.get("captured") for e in entries if e.kind == "segment"]


def test_collectives_of_a_capturable_group_are_captured_in_one_segment(
    host: loom_cudagraph.HostCapturer, gloo_capturable: None
) -> None:
    entries = _run(host)
    assert _segments(entries) == [True]
    assert not [e for e in entries if e.kind == "skip"]
    # call 1 warms up, call 2 records and replays once, calls 3 and 4 replay
    assert host.captures == 1 and host.replays == 3


def test_collectives_of_a_gloo_group_are_skips_that_name_the_backend(
    host: loom_cudagraph.HostCapturer,
) -> None:
    entries = _run(host)
    skips = [e.message for e in entries if e.kind == "skip"]
    assert skips and all("[collective]" in m for m in skips)
    assert any("uses the gloo backend for cpu tensors" in m for m in skips), skips
    assert _segments(entries).count(True) == 2  # each layer's compute


def test_option_off_leaves_every_collective_outside(
    host: loom_cudagraph.HostCapturer, gloo_capturable: None
) -> None:
    entries = _run(host, cudagraph_capture_collectives=False)
    skips = [e.message for e in entries if e.kind == "skip"]
    assert skips and all("collectives run outside CUDA graphs in loom" in m for m in skips)
    assert _segments(entries) == [False, True, False, True, False]


def test_the_capturable_groups_enter_the_cache_key(
    host: loom_cudagraph.HostCapturer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan made where the group's collectives stayed outside does not serve a run
    where they are captured, and the miss says why."""

    def cache() -> str:
        torch._dynamo.reset()
        torchloom.reset()
        _run(host)
        return " | ".join(f"{e.kind}: {e.message}" for e in torchloom.report().entries("cache"))

    assert cache().startswith("miss")
    assert cache().startswith("hit")
    monkeypatch.setattr(collectives_mod, "CAPTURABLE_BACKENDS", frozenset({"nccl", "gloo"}))
    missed = cache()
    assert missed.startswith("miss") and "capturable_groups" in missed, missed
    assert cache().startswith("hit")


class _Sharded(torch.nn.Module):
    """Three layers on weights all-gathered (with autograd: the backward
    reduce-scatters each weight's gradient) from parameter shards, as FSDP2 does."""

    def __init__(self) -> None:
        super().__init__()
        self.shards = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for shard in self.shards:
            w = funcol.all_gather_tensor_autograd(shard, 0, dist.group.WORLD)
            x = torch.tanh(x @ w.T)
        return x.square().mean()


def test_a_training_step_captures_the_gathers_and_reduce_scatters_in_one_segment_each(
    host: loom_cudagraph.HostCapturer, gloo_capturable: None
) -> None:
    torch.manual_seed(0)
    model, ref = _Sharded(), _Sharded()
    ref.load_state_dict(model.state_dict())
    backend = Pipeline(capturer=host, cudagraph_device="cpu")
    compiled = torch.compile(model, backend=backend, options=CG)
    train_like_eager(compiled, model, ref, (torch.randn(3, WIDTH) for _ in range(4)))
    (record,) = torchloom.report()
    for graph, collective in (("forward", "all_gather"), ("backward", "reduce_scatter")):
        plan = record.plan(f"cudagraph.{graph}")
        assert [s.captured for s in plan.segments] == [True], plan.summary()
        (segment,) = plan.segments
        assert any(n.startswith(collective) for n in segment.nodes), segment.nodes
        assert any(n.startswith("wait_tensor") for n in segment.nodes)
    assert not [e for e in torchloom.report().entries("cudagraph") if e.kind == "skip"]
