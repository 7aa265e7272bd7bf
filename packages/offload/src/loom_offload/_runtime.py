"""The transfer runtime: one transfer stream, host pool and set of in-flight copies per device.

Forward (:meth:`Transfers.offload`): the transfer stream waits for the compute
stream (the saved tensor is made), copies the tensor into a pool block, and
records an event. The device tensor stays referenced here while its copy is in
flight; once more than the forward window is in flight, the compute stream waits
on the oldest copy's event and that tensor is let go, so the caching allocator
reuses its memory in compute-stream order, after the copy completed. No host
synchronisation: the host only enqueues.

Backward (:meth:`Transfers.reload`): a reload not already issued is issued now
(the destination is allocated on the compute stream; the transfer stream waits for
the compute stream up to here, so the memory's previous users are done), the
prefetches the lowering scheduled at this reload are issued after it, and the
compute stream waits on this tensor's event only. The first reload of a backward
also lets go of what the forward still held.

On a device without streams (the CPU), every copy is synchronous.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence

import torch

from loom_offload._pool import HostPool, PoolStats

__all__ = [
    "OffloadUnderCapture",
    "TransferStats",
    "Transfers",
    "pool_stats",
    "release_pools",
    "transfers_for",
]

log = logging.getLogger("torchloom.offload")


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    """Counters of one device's transfers since the process started (or the last reset)."""

    offloaded: int
    offloaded_bytes: int
    reloaded: int
    reloaded_bytes: int
    prefetched: int
    forward_waits: int


@dataclasses.dataclass(slots=True)
class _InFlight:
    tensor: torch.Tensor
    event: torch.cuda.Event | None
    nbytes: int


class OffloadUnderCapture(RuntimeError):
    """An offload operator ran while the current stream was capturing a CUDA graph."""


class Transfers:
    """Copies between one device and the host, off the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.pool = HostPool(pin=self.cuda)
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._pending_bytes = 0
        self._reloads: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._counts = collections.Counter[str]()

    # --- forward ---------------------------------------------------------------------------

    def offload(self, t: torch.Tensor, window_bytes: int) -> torch.Tensor:
        """Start copying ``t`` to a pool block; the block (a view with ``t``'s layout)."""
        host = self.pool.take_like(t)
        nbytes = t.numel() * t.element_size()
        self._counts.update(offloaded=1, offloaded_bytes=nbytes)
        if self.stream is None:
            host.copy_(t)
            return host
        compute = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            raise OffloadUnderCapture(
                "loom_offload: an offload ran inside a CUDA-graph capture (capture_step or "
                "torch.cuda.graph): its host pool and events live outside any graph. Compile "
                "the model with options={'offload': False} to capture the hooks' own copies, "
                "or run the step uncaptured"
            )
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self._pending.append(_InFlight(t, event, nbytes))
        self._pending_bytes += nbytes
        while self._pending_bytes > window_bytes and len(self._pending) > 1:
            self._let_go(compute)
        return host

    def _let_go(self, compute: torch.cuda.Stream) -> None:
        oldest = self._pending.popleft()
        self._pending_bytes -= oldest.nbytes
        if oldest.event is not None:
            compute.wait_event(oldest.event)
            self._counts.update(forward_waits=1)

    def let_go_all(self) -> None:
        """The compute stream waits for every copy in flight; their tensors are let go."""
        if not self._pending:
            return
        compute = torch.cuda.current_stream(self.device)
        while self._pending:
            self._let_go(compute)

    # --- backward --------------------------------------------------------------------------

    def reload(self, host: torch.Tensor, prefetch: Sequence[torch.Tensor]) -> torch.Tensor:
        """``host`` back on this device, once its copy completed (for the compute stream);
        then the reloads of ``prefetch`` are started."""
        self.let_go_all()
        entry = self._reloads.pop(host.data_ptr(), None)
        if entry is None:
            entry = self._issue(host)
        for ahead in prefetch:
            if ahead.data_ptr() not in self._reloads:
                self._reloads[ahead.data_ptr()] = self._issue(ahead)
                self._counts.update(prefetched=1)
        device_tensor, event = entry
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return device_tensor

    def _issue(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        self._counts.update(reloaded=1, reloaded_bytes=host.numel() * host.element_size())
        if self.stream is None:
            out.copy_(host)
            return out, None
        # NOTE: ``out`` comes from the compute stream's pool: the transfer stream waits
        # for the compute stream up to here, so the block's earlier readers are done.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return out, event

    def forget_reloads(self) -> None:
        """Drop prefetched reloads nothing consumed (a backward that did not finish)."""
        self.let_go_all()
        if self._reloads:
            compute = torch.cuda.current_stream(self.device) if self.cuda else None
            for _, event in self._reloads.values():
                if compute is not None and event is not None:
                    compute.wait_event(event)
            self._reloads.clear()

    def stats(self) -> TransferStats:
        c = self._counts
        return TransferStats(
            offloaded=c["offloaded"],
            offloaded_bytes=c["offloaded_bytes"],
            reloaded=c["reloaded"],
            reloaded_bytes=c["reloaded_bytes"],
            prefetched=c["prefetched"],
            forward_waits=c["forward_waits"],
        )

    def reset_stats(self) -> None:
        self._counts.clear()


_transfers: dict[torch.device, Transfers] = {}
_lock = threading.Lock()


def transfers_for(device: torch.device) -> Transfers:
    """The device's :class:`Transfers` (made on first use, kept for the process)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _transfers.get(device)
    if found is None:
        with _lock:
            found = _transfers.setdefault(device, Transfers(device))
    return found


def pool_stats() -> dict[str, PoolStats]:
    """Each device's host pool, by device name."""
    return {str(d): t.pool.stats() for d, t in _transfers.items()}


def release_pools() -> int:
    """Let go of in-flight tensors and unconsumed reloads, and give back every host
    block nothing holds; the bytes given back."""
    freed = 0
    for t in _transfers.values():
        t.forget_reloads()
        freed += t.pool.release_free()
    return freed
