"""The host pool: pinned blocks that live across steps, handed out by size.

A block is a flat ``uint8`` tensor; what the pool hands out is a view of it with
the saved tensor's dtype, sizes and strides. A block is free again when the pool
holds the only reference to its storage: every view (the packed value autograd
keeps for the backward, a retained graph's copy) keeps it taken, so a block is
never written while anything can still read it. Device-side order needs no event:
every copy into or out of a block runs on the one transfer stream of its device,
so a new device-to-host copy into a block runs after the last reload read it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from loom_offload._torch_compat import is_non_overlapping_and_dense, storage_references

__all__ = ["HostPool", "PoolStats", "dense_span"]

log = logging.getLogger("torchloom.offload")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """What the pool holds: blocks and bytes, and how often a request was served by
    an existing block (``reused``) or made a new one (``allocated``)."""

    blocks: int
    bytes: int
    taken: int
    allocated: int
    reused: int


def dense_span(t: torch.Tensor) -> int | None:
    """Elements a buffer needs to hold ``t`` with its own strides, or ``None`` when its
    strides overlap or leave gaps (then it is copied contiguous)."""
    if not is_non_overlapping_and_dense(t):
        return None
    return t.numel()


class HostPool:
    """Pinned (or, where pinning is unavailable, pageable) host blocks by byte size."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._blocks: dict[int, list[torch.Tensor]] = {}
        self._next: dict[int, int] = {}  # per size: where the next search starts
        self._lock = threading.Lock()
        self._allocated = 0
        self._reused = 0

    def take_like(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with ``t``'s dtype, sizes and (when dense) strides, from the pool."""
        span = dense_span(t)
        stride = t.stride() if span is not None else _contiguous_strides(t.shape)
        count = t.numel() if span is None else span
        block = self._take(max(count, 1) * t.element_size())
        flat = block.view(t.dtype)[:count]
        return flat.as_strided(t.shape, stride)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            blocks = self._blocks.setdefault(nbytes, [])
            # NOTE: a step takes its blocks in the order the previous step did, so the
            # search starts after the last block handed out: one probe in steady state.
            start = self._next.get(nbytes, 0)
            for k in range(len(blocks)):
                i = (start + k) % len(blocks)
                if storage_references(blocks[i]) == 1:
                    self._reused += 1
                    self._next[nbytes] = i + 1
                    return blocks[i]
            block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            blocks.append(block)
            self._next[nbytes] = len(blocks)
            self._allocated += 1
            log.debug("offload pool: new %s block of %d bytes", _kind(self.pin), nbytes)
            return block

    def stats(self) -> PoolStats:
        with self._lock:
            blocks = [b for bs in self._blocks.values() for b in bs]
            return PoolStats(
                blocks=len(blocks),
                bytes=sum(b.numel() for b in blocks),
                taken=sum(storage_references(b) > 1 for b in blocks),
                allocated=self._allocated,
                reused=self._reused,
            )

    def release_free(self) -> int:
        """Drop the blocks nothing holds; the bytes given back."""
        freed = 0
        with self._lock:
            for nbytes, blocks in self._blocks.items():
                keep = [b for b in blocks if storage_references(b) > 1]
                freed += nbytes * (len(blocks) - len(keep))
                blocks[:] = keep
        return freed


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _kind(pin: bool) -> str:
    return "pinned" if pin else "pageable"
