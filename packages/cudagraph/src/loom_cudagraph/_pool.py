"""Memory pools and the output-liveness rule that keeps held outputs intact.

A replay writes its outputs and intermediates into memory its pool handed out
at capture. Recordings that share a pool are replayed in the order they were
captured; a recording captured *later* may have been given memory that an
earlier one uses for intermediates. So before a recording replays, every
output handed out by it or by a later recording of the same pool must be dead.

Liveness is read from the storage's use count: our own references form a
baseline measured right after capture; anything above it is a user (or an
autograd saved tensor) still holding the output. A held output's recording is
*retired*: its held storages stay alive as orphans (replays that could
overwrite them are refused until they die) and the next recording of that
segment copies those outputs out instead of handing out its static memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from loom_cudagraph._torch_compat import storage_use_count

__all__ = ["MemoryPool", "Watch"]

UseCount = Callable[[int], int]


class PooledRecording(Protocol):
    order: int
    watch: list[Watch]
    #: (pool version, [(cdata, baseline)] of this and every later recording): a cache.
    checks: tuple[int, list[tuple[int, int]]]

    def retire(self, held: list[Watch]) -> None: ...


@dataclasses.dataclass(slots=True)
class Watch:
    """One storage a recording hands out: its address, our reference count, the
    output positions that alias it, and the tensors that keep it alive."""

    cdata: int
    baseline: int
    positions: tuple[int, ...]
    keep: tuple[Any, ...]


@dataclasses.dataclass(slots=True)
class _Orphan:
    watch: Watch
    order: int


class MemoryPool:
    """A CUDA memory pool plus the recordings captured into it, in capture order.

    ``handle`` is the pool token passed to ``torch.cuda.graph(pool=...)``;
    ``use_count`` reads a storage's use count (injectable for tests).
    """

    _ids = itertools.count()

    def __init__(self, handle: Any = None, use_count: UseCount = storage_use_count) -> None:
        self.handle = handle
        self.id = next(self._ids)
        self.recordings: list[PooledRecording] = []
        self.orphans: list[_Orphan] = []
        self.retired = 0
        self.version = 0
        self._order = itertools.count()
        self._use_count = use_count

    def add(self, rec: PooledRecording) -> None:
        rec.order = next(self._order)
        self.recordings.append(rec)
        self.version += 1

    def held(self, rec: PooledRecording) -> list[Watch]:
        return [w for w in rec.watch if self._use_count(w.cdata) != w.baseline]

    def blocked(self, rec: PooledRecording) -> bool:
        """Whether replaying ``rec`` could overwrite an output someone still holds:
        its own, one of a recording captured after it, or an orphan as recent."""
        if self.orphans:
            self.orphans = [
                o for o in self.orphans if self._use_count(o.watch.cdata) != o.watch.baseline
            ]
            if any(o.order >= rec.order for o in self.orphans):
                return True
        version, checks = rec.checks
        if version != self.version:
            later = [q for q in self.recordings if q.order >= rec.order] or [rec]
            checks = [(w.cdata, w.baseline) for q in later for w in q.watch]
            rec.checks = (self.version, checks)
        use_count = self._use_count
        for cdata, baseline in checks:  # noqa: SIM110 - a generator costs more per call
            if use_count(cdata) != baseline:
                return True
        return False

    def release(self, rec: PooledRecording) -> None:
        """Retire ``rec`` and every later recording whose outputs are held; their
        held storages become orphans that block older recordings until they die."""
        recs = self.recordings
        later = recs[recs.index(rec) :] if rec in recs else [rec]
        for q in later:
            held = self.held(q)
            if held or q is rec:
                self.retire(q, held)

    def retire(self, rec: PooledRecording, held: list[Watch]) -> None:
        """Drop ``rec`` from the pool; its ``held`` storages become orphans."""
        if rec in self.recordings:
            self.recordings.remove(rec)
        self.version += 1
        self.orphans.extend(_Orphan(w, rec.order) for w in held)
        self.retired += 1
        rec.retire(held)
