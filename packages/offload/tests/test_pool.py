"""The host pool and the two operators on the CPU (copies are synchronous there)."""

from __future__ import annotations

import torch

import loom_offload


def test_a_block_is_taken_while_a_view_lives_and_reused_after() -> None:
    pool = loom_offload.HostPool(pin=False)
    t = torch.randn(8, 32).t()
    first = pool.take_like(t)
    ptr = first.data_ptr()
    second = pool.take_like(t)
    assert second.data_ptr() != ptr, "a block whose view lives is handed out again"
    del first
    third = pool.take_like(t)
    assert third.data_ptr() == ptr
    stats = pool.stats()
    assert (stats.blocks, stats.allocated, stats.reused, stats.taken) == (2, 2, 1, 2)
    del second, third
    assert pool.release_free() == 2 * t.numel() * t.element_size()
    assert pool.stats().blocks == 0


def test_offload_and_reload_keep_values_and_strides() -> None:
    for t in (torch.randn(16, 8).t(), torch.randn(2, 3, 4).permute(2, 0, 1), torch.arange(6)):
        host = loom_offload.offload_op(t, 1 << 20)
        assert host.device.type == "cpu" and host.stride() == t.stride()
        back = loom_offload.reload_op(host, t.device, [])
        assert torch.equal(back, t) and back.stride() == t.stride()


def test_a_tensor_with_gaps_is_copied_contiguous() -> None:
    t = torch.randn(8, 8)[:, :3]
    host = loom_offload.offload_op(t, 1 << 20)
    assert host.is_contiguous() and torch.equal(host, t)


def test_reload_counts_prefetches_once() -> None:
    transfers = loom_offload.transfers_for(torch.device("cpu"))
    a, b = torch.randn(64), torch.randn(64)
    ha, hb = (loom_offload.offload_op(x, 1 << 20) for x in (a, b))
    before = transfers.stats()
    assert torch.equal(loom_offload.reload_op(ha, torch.device("cpu"), [hb]), a)
    assert torch.equal(loom_offload.reload_op(hb, torch.device("cpu"), []), b)
    after = transfers.stats()
    assert after.prefetched - before.prefetched == 1
    assert after.reloaded - before.reloaded == 2
