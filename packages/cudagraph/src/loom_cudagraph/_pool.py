"""Memory pools and the output-liveness rules that keep held outputs intact.

A replay writes its outputs and intermediates into memory its pool handed out
at capture. Recordings that share a pool are replayed in the order they were
captured; a recording captured *later* may have been given memory that an
earlier one uses for intermediates. So before a recording replays, every
output handed out by it or by a later recording of the same pool must be dead.

A recording does not own its outputs' memory. The call that records it hands
out the tensors the capture allocated (the *originals*); the recording keeps
non-owning twins over the same memory, and later replays hand out aliases of
those. When an original dies (the saved activations a backward consumes, a
logits tensor the user dropped), its block goes back to the pool and a later
capture into the pool (the backward's) may reuse it, as eager would. That
later recording must then not replay while the earlier output lives again:
each recording keeps the earlier outputs whose originals were dead when it
was captured (``reuse``), and replays only when they are dead, except for the
references its own argument list holds (the backward's inputs), which die as
they did during the capture.

Liveness is read from the twin storage's use count: our own references form
a baseline measured right after capture; anything above it is a user (or an
autograd saved tensor) still holding an alias. Originals are watched through
weak references. A held output's recording is *retired*: its held storages
stay alive as orphans (replays that could overwrite them are refused until
they die) and the next recording of that segment copies those outputs out
instead of handing out its static memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from loom_cudagraph._arena import CopyArena
from loom_cudagraph._torch_compat import StorageWeakRef, storage_use_count

__all__ = ["MemoryPool", "Reuse", "Watch", "adopt_if_held", "prune_adopted"]

UseCount = Callable[[int], int]


class PooledRecording(Protocol):
    order: int
    watch: list[Watch]
    #: (pool version, [(cdata, baseline)] of this and every later recording): a cache.
    checks: tuple[int, list[tuple[int, int]]]

    def retire(self, held: list[Watch]) -> None: ...


@dataclasses.dataclass(slots=True, eq=False)
class Watch:
    """One storage a recording hands out: its twin's address (``cdata``), our
    reference count on the twin, the output positions that alias it, the tensors
    that keep the twin alive, the memory's address (``ptr``), and a weak
    reference to the original the capture allocated (``None`` once it died, or
    when the recording owns the memory: ``owned``)."""

    cdata: int
    baseline: int
    positions: tuple[int, ...]
    keep: tuple[Any, ...]
    ptr: int = 0
    origin: StorageWeakRef | None = None
    owned: bool = True
    order: int = -1

    def original_alive(self) -> bool:
        origin = self.origin
        if origin is None:
            return False
        if origin.expired():
            self.origin = None
            return False
        return True


#: An earlier output whose memory a recording may reuse, with the positions of
#: that recording's inputs that alias it (references that die during the replay).
Reuse = tuple[Watch, tuple[int, ...]]


@dataclasses.dataclass(slots=True)
class _Orphan:
    watch: Watch
    order: int
    #: the retired recording: its graph keeps the memory the twin views
    owner: Any = None


#: Graphs of recordings that died while someone still held one of their outputs
#: (a twin's alias): kept, and with them the memory the alias views, until
#: those outputs die.
_adopted: list[tuple[list[Watch], Any]] = []


def adopt_if_held(
    graph: Any, watches: list[Watch], use_count: UseCount = storage_use_count
) -> None:
    """A recording died (its segment, runtime or pool went): keep its ``graph`` if
    an output it handed out without owning is still held."""
    if any(not w.owned and _held(w, use_count) for w in watches):
        _adopted.append((watches, graph))


def prune_adopted(use_count: UseCount = storage_use_count) -> None:
    """Let go of adopted graphs none of whose outputs is held any more."""
    _adopted[:] = [
        (ws, graph)
        for ws, graph in _adopted
        if any(not w.owned and _held(w, use_count) for w in ws)
    ]


def _held(w: Watch, use_count: UseCount) -> bool:
    return use_count(w.cdata) != w.baseline or w.original_alive()


def _listed_only(inputs: Sequence[Any], positions: tuple[int, ...]) -> int:
    """How many distinct objects sit at ``positions`` of ``inputs`` when each is
    referenced by the list alone (once per position it fills), else -1."""
    occurrences: dict[int, int] = {}
    for i in positions:
        k = id(inputs[i])
        occurrences[k] = occurrences.get(k, 0) + 1
    for i in positions:
        t = inputs[i]
        # NOTE: the list's references, the local name and getrefcount's argument
        if sys.getrefcount(t) != occurrences[id(t)] + 2:
            return -1
    return len(occurrences)


class MemoryPool:
    """A CUDA memory pool plus the recordings captured into it, in capture order.

    ``handle`` is the pool token passed to ``torch.cuda.graph(pool=...)``;
    ``use_count`` reads a storage's use count (injectable for tests). ``arena``
    holds the copy-in buffers its recordings share (see ``_arena``).
    """

    _ids = itertools.count()

    def __init__(self, handle: Any = None, use_count: UseCount = storage_use_count) -> None:
        self.handle = handle
        self.id = next(self._ids)
        self.recordings: list[PooledRecording] = []
        self.orphans: list[_Orphan] = []
        #: watches whose originals may still be alive (dropped as they die)
        self.originals: list[Watch] = []
        self.retired = 0
        self.version = 0
        self._order = itertools.count()
        self._use_count = use_count
        self.arena = CopyArena()

    def add(self, rec: PooledRecording) -> None:
        rec.order = next(self._order)
        for w in rec.watch:
            w.order = rec.order
            if w.origin is not None:
                self.originals.append(w)
        self.recordings.append(rec)
        self.version += 1

    def held(self, rec: PooledRecording) -> list[Watch]:
        return [w for w in rec.watch if _held(w, self._use_count)]

    def blocked(self, rec: PooledRecording) -> bool:
        """Whether replaying ``rec`` could overwrite an output someone still holds:
        its own, one of a recording captured after it, or an orphan as recent."""
        if self.orphans:
            self.orphans[:] = [o for o in self.orphans if _held(o.watch, self._use_count)]
            if any(o.order >= rec.order for o in self.orphans):
                return True
        if self.originals:
            self.originals = [w for w in self.originals if w.original_alive()]
            if any(w.order >= rec.order for w in self.originals):
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

    def reusable(self, ptrs: dict[int, list[int]]) -> list[Reuse]:
        """The outputs of this pool's recordings and orphans whose memory a capture
        starting now may be given (their originals died), each with the positions
        of the capture's inputs that view that memory (``ptrs``: memory address to
        input positions)."""
        found: list[Reuse] = []
        watches = [w for q in self.recordings for w in q.watch]
        watches.extend(o.watch for o in self.orphans)
        for w in watches:
            if not w.owned and not w.original_alive():
                found.append((w, tuple(ptrs.get(w.ptr, ()))))
        return found

    def reuse_free(self, reuse: list[Reuse], inputs: Sequence[Any]) -> bool:
        """Whether every earlier output in ``reuse`` is dead but for the references
        ``inputs`` holds alone (they die during the replay, as during the capture)."""
        return self._first_held(reuse, inputs) is None

    def _first_held(self, reuse: list[Reuse], inputs: Sequence[Any]) -> Reuse | None:
        # NOTE: on a backward's per-call path (one entry per reused output).
        use_count = self._use_count
        for entry in reuse:
            w, positions = entry
            if not positions:
                if use_count(w.cdata) != w.baseline:
                    return entry
            elif len(positions) == 1:
                # the list's reference and getrefcount's argument
                if sys.getrefcount(inputs[positions[0]]) != 2 or use_count(w.cdata) != (
                    w.baseline + 1
                ):
                    return entry
            else:
                listed = _listed_only(inputs, positions)
                if listed < 0 or use_count(w.cdata) != w.baseline + listed:
                    return entry
        return None

    def describe_reuse(self, reuse: list[Reuse], inputs: Sequence[Any]) -> str:
        """The first reused output that is held, for a debug log."""
        entry = self._first_held(reuse, inputs)
        if entry is None:
            return "none"
        w, positions = entry
        refs = [sys.getrefcount(inputs[i]) - 1 for i in positions]
        return (
            f"output {w.positions} of recording {w.order}: {self._use_count(w.cdata)} uses, "
            f"{w.baseline} ours, inputs {list(positions)} with refcounts {refs}"
        )

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
        self.orphans.extend(_Orphan(w, rec.order, rec) for w in held)
        self.retired += 1
        rec.retire(held)
