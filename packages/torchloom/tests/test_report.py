"""The report keeps the steps' plans and refusals as the packages' typed values and
renders text only when asked (``Report.format``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import loom_cache
import loom_cudagraph
import loom_resize
import torchloom
from torchloom import Pipeline
from torchloom._hooks import HooksPlan
from torchloom._options import resolve_options
from torchloom._pipeline import compile_graph


@pytest.fixture
def host() -> Iterator[Pipeline]:
    """A pipeline whose CUDA graphs are host graphs on CPU, with a fresh report."""
    torchloom.reset()
    loom_cudagraph.reset_skip_counts()
    loom_cudagraph.mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
    yield Pipeline(capturer=loom_cudagraph.HostCapturer(), cudagraph_device="cpu")
    loom_cudagraph.unmark_non_capturable(torch.ops.aten.sin)
    torchloom.reset()


def test_plans_are_read_back_from_the_report_as_typed_values(host: Pipeline) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.relu(x @ w)) * 2

    compiled = torch.compile(f, backend=host, options={"codegen": "eager", "cudagraphs": True})
    x, w = torch.randn(2, 4), torch.randn(4, 4, requires_grad=True)
    compiled(x, w).sum().backward()
    (record,) = torchloom.report()

    forward = record.plan("cudagraph.forward")
    assert isinstance(forward, loom_cudagraph.PartitionPlan)
    assert isinstance(record.plan("cudagraph.backward"), loom_cudagraph.PartitionPlan)
    forward.check()
    segments = [
        e for e in record.entries if e.kind == "segment" and e.get("graph") == forward.graph
    ]
    assert [(s.get("segment"), s.get("captured")) for s in segments] == [
        (seg.index, seg.captured) for seg in forward.segments
    ]
    assert isinstance(record.plan("resize"), loom_resize.ResizePlan)
    assert not record.plan("resize")  # no storage resizes in this graph
    hooks = record.plan("hooks")
    assert isinstance(hooks, HooksPlan) and hooks.pair is None
    key = record.plan("cache")
    assert isinstance(key, loom_cache.CacheKey)
    (miss,) = [e for e in record.entries if e.area == "cache" and e.kind == "miss"]
    assert miss.get("digest") == key.digest
    assert record.plan("no such plan") is None

    # A skip keeps the package's own refusal; the text is rendered from it on request.
    skip = next(e for e in record.entries if e.kind == "skip")
    refusal = skip.refusal
    assert isinstance(refusal, loom_cudagraph.Unsupported)
    assert refusal.kind is loom_cudagraph.CudagraphRefusalKind.USER_MARKED
    assert refusal in forward.skips()
    assert str(refusal) in torchloom.report().format()


def test_a_fallback_keeps_the_typed_refusal(host: Pipeline) -> None:
    gm = torch.fx.symbolic_trace(lambda x: x)  # no tensor work: runs as Python
    fn = compile_graph(gm, [torch.randn(2)], resolve_options(), host)
    assert fn is not None
    (record,) = torchloom.report()
    refusal = record.refusal
    assert refusal is not None and refusal.kind is torchloom.RefusalKind.NO_TENSOR_WORK
    (entry,) = [e for e in record.entries if e.kind == "fallback"]
    assert entry.refusal is refusal
    assert record.fallback == str(refusal) and str(refusal) in torchloom.report().format()
