"""Saved-tensor hooks on CUDA tensors: fp8 packing and CPU offload, traced and run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loom_tracer import TracedHook, trace_hook

sys.path.insert(0, str(Path(__file__).parent))
from test_tracer_corpus import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCALE = 16.0


def pack_fp8(t):
    if t.dtype == torch.float32 and t.numel() > 8:
        return (t.dtype, (t * SCALE).to(torch.float8_e4m3fn))
    return (t.dtype, t)


def unpack_fp8(packed):
    dtype, data = packed
    return data.to(dtype) / SCALE if data.dtype == torch.float8_e4m3fn else data


def offload(t):
    return (t.device, t.to("cpu"))


def reload(packed):
    device, data = packed
    return data.to(device, non_blocking=True)


def _traced(fn: Any, *args: Any) -> TracedHook:
    result = trace_hook(fn, args)
    assert isinstance(result, TracedHook), str(result)
    assert result.check_guards(*args)
    return result


def test_fp8_pack_and_unpack_on_cuda_match_eager() -> None:
    x = torch.randn(64, 32, device="cuda")
    pack = _traced(pack_fp8, x)
    packed = pack.run(x)
    assert_same(pack_fp8(x), packed)
    unpack = _traced(unpack_fp8, packed)
    assert_same(unpack_fp8(packed), unpack.run(packed))
    assert not pack.check_guards(x.cpu())


def test_cpu_offload_round_trip_on_cuda_matches_eager() -> None:
    x = torch.randn(128, device="cuda")
    pack = _traced(offload, x)
    packed = pack.run(x)
    assert packed[1].device.type == "cpu"
    assert_same(offload(x), packed)
    unpack = _traced(reload, packed)
    out = unpack.run(packed)
    torch.cuda.synchronize()
    assert out.device.type == "cuda"
    assert_same(reload(packed), out)


def cuda_offload_hooks() -> tuple[Any, Any]:
    """The user's async offload pair of issue 45 (torchtune's OffloadActivations, reduced)."""
    side = torch.cuda.Stream()

    def pack(t):
        if t.numel() < 65536:
            return (t.device, t)
        cpu = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cpu.copy_(t, non_blocking=True)
        t.record_stream(side)
        return (t.device, cpu)

    def unpack(packed):
        device, cpu = packed
        torch.cuda.current_stream().wait_stream(side)
        return cpu.to(device, non_blocking=True)

    return pack, unpack


def test_cuda_stream_offload_pair_traces_drops_its_stream_ops_and_matches_eager() -> None:
    pack, unpack = cuda_offload_hooks()
    x = torch.randn(256, 512, device="cuda")
    traced_pack = _traced(pack, x)
    assert [op.split(" at ")[0] for op in traced_pack.stream_ops] == [
        "torch.cuda.Stream.wait_stream",
        "with torch.cuda.stream",
        "Tensor.record_stream",
    ]
    assert "torch.cuda.is_available() -> True" in traced_pack.process_constants
    packed = traced_pack.run(x)
    expected = pack(x)
    torch.cuda.synchronize()
    assert packed[1].device.type == "cpu"
    assert_same(expected, packed)
    traced_unpack = _traced(unpack, packed)
    assert [op.split(" at ")[0] for op in traced_unpack.stream_ops] == [
        "torch.cuda.Stream.wait_stream"
    ]
    out = traced_unpack.run(packed)
    torch.cuda.synchronize()
    assert_same(unpack(packed), out)
    assert torch.equal(out, x)
    # a new side stream each step serves the same traces: the stream's type is guarded
    (cell,) = [c for c in pack.__closure__ if isinstance(c.cell_contents, torch.cuda.Stream)]
    cell.cell_contents = torch.cuda.Stream()
    assert traced_pack.check_guards(x) and traced_unpack.check_guards(packed)
    small = torch.randn(8, device="cuda")
    assert _traced(pack, small).stream_ops == ()
