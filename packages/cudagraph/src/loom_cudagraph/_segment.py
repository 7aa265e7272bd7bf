"""One captured segment at run time: warm-up, recordings, dispatch and replay.

Per distinct input shape (one key for static graphs) a segment keeps up to
``max_recording`` recordings, dispatched by the addresses of the inputs used
in place (parameters, buffers, outputs of other loom CUDA graphs, and inputs
that kept their address from the warm-up to the recording). Other tensor
inputs are copied into static buffers, shared by the recordings of one pool
(``_arena``) except where an output views the input; once an input used in
place only for its stable address moves, that shape copies such inputs from
then on. Which
inputs are used in place, copied, or copied back after a mutation is decided
once, when a recording is made, together with the callables the per-call path
runs: one pointer check in C++ (only when some input is used in place), the
output-liveness check, one (fused) copy, the replay and one alias per
escaping output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from loom_cudagraph._arena import own_buffer
from loom_cudagraph._capture import Capturer
from loom_cudagraph._options import CudagraphOptions
from loom_cudagraph._pool import MemoryPool, Reuse, Watch, adopt_if_held, prune_adopted
from loom_cudagraph._reasons import CudagraphRefusalKind, Unsupported
from loom_cudagraph._skiplog import report_skip
from loom_cudagraph._torch_compat import (
    StorageWeakRef,
    data_ptrs_at_indices_equal,
    foreach_copy_,
    mark_boxed,
    non_overlapping_and_dense,
    non_owning_alias,
    storage_id,
    storage_use_count,
    storage_weak_ref,
)

__all__ = ["CapturedSegment", "SegmentSpec", "SegmentStats", "is_managed", "suspended"]

log = logging.getLogger("torchloom.cudagraph")

SegmentFn = Callable[[list[Any]], Sequence[Any]]

#: Recordings in a row that may each be replaced before a second replay because their
#: static inputs moved with their storage; the next such move declines the shape.
REALLOCATED_CHAIN = 2

# Memory (storage addresses) of static outputs of live recordings: an input found
# here is used in place.
_managed: dict[int, int] = {}


# How many ``suspended()`` blocks are open: while one is, segments run their code as is.
_suspended = 0


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Every loom CUDA-graph segment runs its compiled code directly (no warm-up, no
    recording, no replay) while the block runs.

    For an outer capture of a whole step (``torchloom.capture_step``): a segment's
    own capture or replay inside another stream capture would fail, and its code is
    captured into the outer graph anyway.
    """
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def is_managed(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in memory a loom CUDA graph writes (an output of a recording)."""
    return _memory(t) in _managed


def _memory(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (shared by a recording's outputs and their twins)."""
    return int(t.untyped_storage().data_ptr())


def _aliasable(t: torch.Tensor) -> bool:
    """Whether a recording may keep ``t`` through a non-owning twin (see ``_pool``)."""
    return t.layout == torch.strided and not t.requires_grad and _memory(t) != 0


def _forget(cdatas: list[int]) -> None:
    _manage(cdatas, -1)


def _manage(cdatas: Sequence[int], delta: int) -> None:
    for c in cdatas:
        n = _managed.get(c, 0) + delta
        if n > 0:
            _managed[c] = n
        else:
            _managed.pop(c, None)


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentSpec:
    """What the runtime knows about a segment before any call (from the plan)."""

    name: str
    input_names: tuple[str, ...]
    input_sources: tuple[str, ...]
    static_positions: frozenset[int]
    mutated_positions: frozenset[int]
    escaping_outputs: frozenset[int]
    dynamic: bool
    options: CudagraphOptions
    nodes: int = 0
    #: (output position, input position) of each input returned unchanged
    passthrough: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentStats:
    """A snapshot of one segment for ``torchloom.report()``."""

    name: str
    captured: bool
    reasons: tuple[Unsupported, ...]
    nodes: int
    recordings: int
    shapes: int
    replays: int
    uncaptured_calls: int
    pool_bytes: int
    copied_out: tuple[int, ...] = ()


#: Told about each recording and runtime skip: ``listener(stats, event)``.
Listener = Callable[[SegmentStats, str], None]


class _Recording:
    """One CUDA graph of a segment: which inputs it reads in place (and at which
    addresses), its static buffers, outputs, and the callables the per-call
    path runs, all fixed when it is recorded."""

    __slots__ = (
        "__weakref__",
        "alias_idx",
        "bufs",
        "chain",
        "checks",
        "clone_idx",
        "copy_back",
        "copy_idx",
        "copy_in",
        "copyback_bufs",
        "copyback_idx",
        "graph",
        "inplace_idx",
        "lent",
        "managed",
        "order",
        "outputs",
        "pool",
        "ptrs",
        "replay",
        "replays_then",
        "retired",
        "reuse",
        "stable_idx",
        "storages",
        "table",
        "through",
        "watch",
    )

    def __init__(self, table: _Table, pool: MemoryPool) -> None:
        self.table = table
        self.pool = pool
        self.order = -1
        self.graph: Any = None
        self.inplace_idx: list[int] = []
        #: the in-place inputs that are there only because their address held still
        self.stable_idx: list[int] = []
        self.ptrs: list[int | None] = []
        #: the storages of the in-place inputs at recording time, by position
        self.storages: dict[int, int] = {}
        self.copy_idx: list[int] = []
        self.bufs: list[torch.Tensor] = []
        #: storages of ``bufs`` shared with other recordings of the pool
        self.lent: frozenset[int] = frozenset()
        self.copyback_idx: list[int] = []
        self.copyback_bufs: list[torch.Tensor] = []
        self.outputs: list[Any] = []
        #: (output, input) positions of in-place inputs passed through: the call's own
        #: input is handed out (the recording keeps no reference to it)
        self.through: tuple[tuple[int, int], ...] = ()
        self.alias_idx: tuple[int, ...] = ()
        self.clone_idx: tuple[int, ...] = ()
        self.watch: list[Watch] = []
        self.checks: tuple[int, list[tuple[int, int]]] = (-1, [])
        self.managed: list[int] = []
        #: earlier outputs of the pool whose memory this recording may have reused
        self.reuse: list[Reuse] = []
        self.retired = False
        #: recordings in a row, ending with this one, that each replaced the last
        #: because its in-place inputs moved with their storage before it replayed again
        self.chain = 1
        #: the segment's replay count right after this recording's own first replay
        self.replays_then = -1
        self.copy_in: Callable[[list[Any]], object] | None = None
        self.copy_back: Callable[[list[Any]], object] | None = None
        self.replay: Callable[[], object] = _no_replay

    def retire(self, held: list[Watch]) -> None:
        self.retired = True
        self.table.on_retire(self, held)


def _no_replay() -> None:
    raise RuntimeError("loom_cudagraph: a recording was replayed before its capture finished")


def _copy_into(bufs: list[torch.Tensor], idx: list[int]) -> Callable[[list[Any]], object] | None:
    """``bufs[k].copy_(inputs[idx[k]])`` for every ``k``: one copy, or one fused copy."""
    if not idx:
        return None
    if len(idx) == 1:
        copy, i = bufs[0].copy_, idx[0]
        return lambda inputs: copy(inputs[i])
    fused, gather = functools.partial(foreach_copy_, bufs), operator.itemgetter(*idx)
    return lambda inputs: fused(gather(inputs))


def _copy_back(bufs: list[torch.Tensor], idx: list[int]) -> Callable[[list[Any]], object] | None:
    """``inputs[idx[k]].copy_(bufs[k])`` for every ``k`` (a mutated input made whole)."""
    if not idx:
        return None
    if len(idx) == 1:
        buf, i = bufs[0], idx[0]
        return lambda inputs: inputs[i].copy_(buf)
    gather = operator.itemgetter(*idx)
    return lambda inputs: foreach_copy_(gather(inputs), bufs)


class _Table:
    """The recordings of one segment for one input-shape key."""

    __slots__ = (
        "aliased",
        "buffers",
        "copy_out",
        "declined",
        "exhausted",
        "last",
        "made",
        "owner",
        "recordings",
        "retires",
        "unstable",
        "warm_ptrs",
        "warm_storages",
    )

    def __init__(self, owner: CapturedSegment) -> None:
        self.owner = owner
        self.recordings: list[_Recording] = []
        self.last: _Recording | None = None
        self.copy_out: set[int] = set()
        self.made = 0
        self.buffers = 0
        self.retires = 0
        self.exhausted = False
        #: this shape runs uncaptured for good: its static inputs move on every call
        self.declined = False
        #: data pointers of the warm-up call's inputs (``None`` for non-tensors)
        self.warm_ptrs: list[int | None] = []
        #: the warm-up call's input storages, by identity and weakly: an input is
        #: "stable" only while the same storage comes back, not a fresh tensor
        #: that the allocator happened to place at the same address
        self.warm_storages: list[tuple[int, StorageWeakRef] | None] = []
        #: an input used in place for its stable address moved: copy such inputs
        self.unstable = False
        #: input positions some output of the warm-up call viewed: if copied, each
        #: gets a buffer of its own (a shared one would be overwritten under the output)
        self.aliased: frozenset[int] = frozenset()

    def find(self, inputs: list[Any]) -> _Recording | None:
        for rec in self.recordings:
            if data_ptrs_at_indices_equal(inputs, rec.ptrs, rec.inplace_idx):
                return rec
        return None

    def on_retire(self, rec: _Recording, held: list[Watch]) -> None:
        for w in held:
            self.copy_out.update(w.positions)
        if rec in self.recordings:
            self.recordings.remove(rec)
        if self.last is rec:
            self.last = None
        if self.owner._hot is rec:
            self.owner._hot = None
        self.retires += 1
        _manage(rec.managed, -1)
        rec.managed.clear()


class CapturedSegment:
    """Runs one segment as CUDA graphs; a boxed callable ``seg(inputs) -> outputs``.

    ``fn`` is the segment's compiled code (boxed: it takes a list). The first
    call for each input shape is the warm-up and runs ``fn`` directly; the next
    one records and replays.
    """

    def __init__(
        self,
        fn: SegmentFn,
        spec: SegmentSpec,
        capturer: Capturer,
        device: torch.device | None,
        shared_pool: MemoryPool | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.fn = fn
        self.listener = listener
        self.spec = spec
        self.capturer = capturer
        self.device = device
        self.shared_pool = shared_pool
        self._tables: dict[Any, _Table] = {}
        self._dynamic = spec.dynamic
        self._off: Unsupported | None = None
        self._shapes_warned = False
        self._hot: _Recording | None = None
        self.replays = 0
        self.uncaptured_calls = 0
        self.pool_bytes = 0
        #: recordings made before the last :meth:`release` (the stats count them)
        self._released = 0
        mark_boxed(self)

    # --- per call ------------------------------------------------------------------------

    def __call__(self, inputs: list[Any]) -> Sequence[Any]:
        # NOTE: the hot path. ``_hot`` is the recording the last call replayed
        # (static shapes only; dropped when it retires); it replays again if its
        # in-place inputs kept their addresses, no output it hands out is held,
        # and no earlier output whose memory it reuses is held (but by ``inputs``).
        if _suspended:
            return self.fn(inputs)
        rec = self._hot
        if (
            rec is None
            or (
                rec.inplace_idx
                and not data_ptrs_at_indices_equal(inputs, rec.ptrs, rec.inplace_idx)
            )
            or rec.pool.blocked(rec)
            or (rec.reuse and not rec.pool.reuse_free(rec.reuse, inputs))
        ):
            found = self._dispatch(inputs)
            if found is None:
                self.uncaptured_calls += 1
                return self.fn(inputs)
            if not isinstance(found, _Recording):
                return found  # recorded: this call was its first replay
            rec = found
        if rec.copy_in is not None:
            rec.copy_in(inputs)
        rec.replay()
        if rec.copy_back is not None:
            rec.copy_back(inputs)
        self.replays += 1
        outs = rec.outputs.copy()
        for p, i in rec.through:
            outs[p] = inputs[i]
        inputs.clear()
        for p in rec.alias_idx:
            outs[p] = outs[p].detach()
        for p in rec.clone_idx:
            outs[p] = outs[p].clone()
        return outs

    def _dispatch(self, inputs: list[Any]) -> _Recording | Sequence[Any] | None:
        """The recording to replay for ``inputs``; or the outputs of this call when
        it made a new recording (and replayed it) or was a shape's warm-up; ``None``
        runs the call uncaptured (a skip)."""
        if self._off is not None:
            return None
        key = self._key(inputs) if self._dynamic else None
        table = self._tables.get(key)
        if table is None:
            return self._new_shape(key, inputs)
        rec = table.last
        if rec is None or (
            rec.inplace_idx and not data_ptrs_at_indices_equal(inputs, rec.ptrs, rec.inplace_idx)
        ):
            rec = table.find(inputs)
            if rec is None:
                return self._record(table, inputs)
        if not _usable(rec, inputs):
            found = self._unblocked(table, rec, inputs)
            if not isinstance(found, _Recording):
                return found
            rec = found
        table.last = rec
        if not self._dynamic:
            self._hot = rec
        return rec

    def _unblocked(
        self, table: _Table, rec: _Recording, inputs: list[Any]
    ) -> _Recording | Sequence[Any] | None:
        """A recording for these addresses that may replay now: a sibling, a new
        second buffer, or (both busy) a fresh one that copies held outputs out."""
        siblings = [
            r
            for r in table.recordings
            if r is not rec and data_ptrs_at_indices_equal(inputs, r.ptrs, r.inplace_idx)
        ]
        for r in siblings:
            if _usable(r, inputs):
                return r
        if log.isEnabledFor(logging.DEBUG) and not rec.pool.blocked(rec):
            log.debug(
                "cudagraph: %s: an earlier output whose memory it reuses is held: %s",
                self.spec.name,
                rec.pool.describe_reuse(rec.reuse, inputs),
            )
        if siblings:
            for r in (rec, *siblings):
                if r.pool.blocked(r):
                    r.pool.release(r)
        return self._record(table, inputs, alternate=True)

    def _key(self, inputs: list[Any]) -> tuple[Any, ...]:
        return tuple(
            (tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v for v in inputs
        )

    # --- slow paths ------------------------------------------------------------------------

    def _new_shape(self, key: Any, inputs: list[Any]) -> Sequence[Any] | None:
        """Register a new shape key and run this call as its warm-up (its outputs),
        or warn once that the shape budget is spent (``None``: run uncaptured)."""
        if len(self._tables) >= max(1, self.spec.options.max_shapes):
            if not self._shapes_warned:
                self._shapes_warned = True
                self._skip(
                    CudagraphRefusalKind.DYNAMIC_SHAPE_BUDGET,
                    f"input shapes {_shapes(inputs)} are the "
                    f"{len(self._tables) + 1}th distinct set; cudagraph_max_shapes="
                    f"{self.spec.options.max_shapes}, so new shapes run uncaptured",
                    "pad inputs to a few fixed sizes or raise cudagraph_max_shapes",
                )
            return None
        # NOTE: the warm-up is the user's call itself, run uncaptured (it draws
        # the same random numbers as uncaptured compiled code would).
        self._tables[key] = table = _Table(self)
        strided = [isinstance(v, torch.Tensor) and v.layout == torch.strided for v in inputs]
        table.warm_ptrs = [
            v.data_ptr() if s else None for v, s in zip(inputs, strided, strict=True)
        ]
        table.warm_storages = [
            (storage_id(v), storage_weak_ref(v)) if s else None
            for v, s in zip(inputs, strided, strict=True)
        ]
        self.uncaptured_calls += 1
        outs = self.fn(inputs)
        table.aliased = _aliased_inputs(table.warm_storages, outs)
        return outs

    def _record(
        self, table: _Table, inputs: list[Any], alternate: bool = False
    ) -> Sequence[Any] | None:
        """Record a new CUDA graph for ``inputs`` and replay it: this call's outputs
        (the tensors the capture allocated), or ``None`` to run the call uncaptured
        (budget spent; ``inputs`` untouched). The capture takes ``inputs`` over, so
        what the segment's code frees early (a backward's saved activations) is
        freed during the capture and its memory can be reused by it.

        Phases: admit (budget), place each input (in place or copied), pick a pool,
        prepare the recording's buffers, capture, install, first replay."""
        admitted = self._admit(table, inputs, alternate)
        if admitted is None:
            return None
        alternate = admitted
        prune_adopted()
        inplace_idx, stable_idx, copy_idx = self._place_inputs(table, inputs)
        # where the in-place inputs' memory is: the positions that view an earlier
        # output a capture may reuse (see ``MemoryPool.reuse_free``)
        views: dict[int, list[int]] = {}
        for i in inplace_idx:
            if inputs[i].layout == torch.strided:
                views.setdefault(_memory(inputs[i]), []).append(i)
        superseded = None if alternate else _superseded(table, inputs)
        chain = 1
        if superseded is not None and self.replays == superseded.replays_then:
            # NOTE: the recording it replaces never replayed after its own call.
            chain = superseded.chain + 1
            if chain > REALLOCATED_CHAIN:
                self._decline(table, superseded, inputs)
                return None
        if superseded is not None:
            # NOTE: the in-place inputs it reads moved with their storage (FSDP2
            # frees each unsharded parameter's memory after use and allocates it
            # again before the next use): the addresses it baked in belong to
            # nothing of ours any more. It is retired and the new recording takes
            # its pool, so each step's recording reuses the memory of the last one
            # instead of holding a pool of its own (memory grew with every step).
            log.debug(
                "cudagraph: %s: in-place inputs %s moved with their storage; the new "
                "recording replaces recording %d in its pool",
                self.spec.name,
                _moved(superseded, inputs),
                superseded.order,
            )
            superseded.pool.retire(superseded, superseded.pool.held(superseded))
        rec = _Recording(
            table,
            self._pool_for(
                table, inputs, views, alternate, superseded.pool if superseded else None
            ),
        )
        rec.inplace_idx, rec.stable_idx, rec.copy_idx = inplace_idx, stable_idx, copy_idx
        rec.chain = chain
        self._prepare(rec, inputs)
        in_place = {storage_id(inputs[i]) for i in inplace_idx}
        copy_targets = [inputs[i] for i in rec.copyback_idx]
        # NOTE: the capture takes ``inputs`` over, so an input the segment's code
        # frees early dies during the capture, and the replay right after it reads
        # the input's old address. For memory of a loom pool that is fine (the pool
        # keeps it). Any other memory is the caching allocator's: ``empty_cache``
        # (run around each capture) may give the block back to the driver, and the
        # replay faults. So every in-place input that no pool owns is held here
        # until this first replay has read it. (FSDP2 under compiled autograd: the
        # q/k/v views saved by a forward that was declined, read by the backward.)
        unowned = [inputs[i] for i in inplace_idx if not is_managed(inputs[i])]
        originals = self._capture_into(rec, inputs)
        if rec.graph is None:  # the capture failed: the call ran uncaptured
            return originals
        self._install(rec, originals, in_place, views, alternate)
        rec.replay()
        del unowned
        if copy_targets:
            foreach_copy_(copy_targets, rec.copyback_bufs)
        self.replays += 1
        rec.replays_then = self.replays
        for p in rec.clone_idx:
            originals[p] = originals[p].clone()
        return originals

    def _admit(self, table: _Table, inputs: list[Any], alternate: bool) -> bool | None:
        """Whether this recording is an alternate one (spends no budget), or ``None``
        when the budget is spent (warned once) or the shape was declined."""
        if table.declined:
            return None
        limit = max(1, self.spec.options.max_recording)
        if not table.unstable and _stable_input_moved(table, inputs):
            # NOTE: not a static input's new address: no budget is spent, and
            # this shape copies such inputs from now on.
            log.debug("cudagraph: %s: an input with a stable address moved", self.spec.name)
            table.unstable = True
            alternate = True
        if (not alternate and table.made >= limit) or table.retires > limit:
            if not table.exhausted:
                table.exhausted = True
                self._warn_budget(table, inputs)
            return None
        return alternate

    def _place_inputs(
        self, table: _Table, inputs: list[Any]
    ) -> tuple[list[int], list[int], list[int]]:
        """The positions read in place, those of them read in place only for their stable
        address, and those copied into static buffers."""
        static = self.spec.static_positions
        # NOTE: "kept its address since the warm-up" is evidence for the first
        # recording of a shape; a later one reads such an input in place only
        # where an earlier recording already does (else a fresh tensor that the
        # allocator happened to place at the warm-up's address would count).
        stable_ok = (
            {i for r in table.recordings for i in r.stable_idx} if table.recordings else None
        )
        inplace_idx: list[int] = []
        stable_idx: list[int] = []
        copy_idx: list[int] = []
        for i, v in enumerate(inputs):
            if not isinstance(v, torch.Tensor):
                continue
            if (
                i in static
                or isinstance(v, torch.nn.Parameter)
                or is_managed(v)
                or not non_overlapping_and_dense(v)
                or v.device != self.device
            ):
                inplace_idx.append(i)
            elif (
                not table.unstable
                and v.data_ptr() == table.warm_ptrs[i]
                and _same_storage(table.warm_storages[i], v)
                and (stable_ok is None or i in stable_ok)
            ):
                inplace_idx.append(i)
                stable_idx.append(i)
            else:
                copy_idx.append(i)
        return inplace_idx, stable_idx, copy_idx

    def _pool_for(
        self,
        table: _Table,
        inputs: list[Any],
        views: dict[int, list[int]],
        alternate: bool,
        replaced: MemoryPool | None = None,
    ) -> MemoryPool:
        """The shared pool for a shape's first recording (or the pool of the
        recording this one ``replaced``) when no output whose memory went back to
        it is held, else a pool of the recording's own."""
        first = (
            table.made == 0
            and not alternate
            and len(self._tables) == 1
            and self.shared_pool is not None
        )
        pool = replaced if replaced is not None else self.shared_pool if first else None
        if pool is not None and not pool.reuse_free(pool.reusable(views), inputs):
            # NOTE: an output whose memory went back to the shared pool is held
            # again (an alias from a replay): a capture there could be given it.
            log.debug(
                "cudagraph: %s: shared pool busy, recording into its own: %s",
                self.spec.name,
                pool.describe_reuse(pool.reusable(views), inputs),
            )
            pool = None
        return pool if pool is not None else MemoryPool(self.capturer.new_pool_handle())

    def _prepare(self, rec: _Recording, inputs: list[Any]) -> None:
        """The recording's addresses of in-place inputs, static buffers (filled now),
        copy-back buffers of mutated inputs, and its per-call copy callables."""
        copy_idx = rec.copy_idx
        rec.ptrs = [None] * len(inputs)
        for i in rec.inplace_idx:
            rec.ptrs[i] = inputs[i].data_ptr()
            sid = _storage(inputs[i])
            if sid is not None:
                rec.storages[i] = sid
        # NOTE: the copy-in buffers of one pool's recordings are shared (their
        # replays run in program order on one stream, each after its own copy in),
        # alternate recordings in pools of their own included; an input that an
        # output views gets a buffer of its own.
        arena = (self.shared_pool or rec.pool).arena
        shared = [i for i in copy_idx if i not in rec.table.aliased]
        lent = dict(zip(shared, arena.lend([inputs[i] for i in shared]), strict=True))
        rec.bufs = [lent[i] if i in lent else own_buffer(inputs[i]) for i in copy_idx]
        rec.lent = frozenset(storage_id(b) for b in lent.values())
        if copy_idx:
            foreach_copy_(rec.bufs, [inputs[i] for i in copy_idx])
        mutated = self.spec.mutated_positions
        rec.copyback_idx = [i for i in copy_idx if i in mutated]
        rec.copyback_bufs = [b for i, b in zip(copy_idx, rec.bufs, strict=True) if i in mutated]
        rec.copy_in = _copy_into(rec.bufs, copy_idx)
        rec.copy_back = _copy_back(rec.copyback_bufs, rec.copyback_idx)

    def _capture_into(self, rec: _Recording, inputs: list[Any]) -> list[Any]:
        """Capture the segment into ``rec`` (``inputs`` is cleared: the capture takes
        it over) and return the capture's outputs; if the capture fails, the segment
        is off for good (``rec.graph`` stays ``None``) and this call's outputs come
        from running it uncaptured."""
        # NOTE: if the capture fails, the call runs uncaptured on these: the
        # memory of outputs it freed meanwhile is in the private pool, which
        # nothing but a capture into that pool allocates from, so it is intact.
        fallback = [
            non_owning_alias(v)
            if isinstance(v, torch.Tensor) and is_managed(v) and _aliasable(v)
            else v
            for v in inputs
        ]
        cap_inputs = list(inputs)
        for i, buf in zip(rec.copy_idx, rec.bufs, strict=True):
            cap_inputs[i] = buf
        inputs.clear()
        before = self.capturer.reserved()
        try:
            rec.graph, originals = self.capturer.capture(self.fn, cap_inputs, rec.pool.handle)
        except Exception as exc:
            return self._turn_off(
                rec,
                fallback,
                f"capture raised {type(exc).__name__}: {exc}",
                "report the op; mark it with loom_cudagraph.mark_non_capturable meanwhile",
            )
        del cap_inputs
        if rec.lent and any(_storage(o) in rec.lent for o in originals):
            # NOTE: never expected (the warm-up call's outputs viewed no such input):
            # a later recording of the pool would overwrite this output while it lives.
            del originals
            return self._turn_off(
                rec,
                fallback,
                "an output of the capture views a copy-in buffer shared with other "
                "recordings of its pool, though the warm-up call's outputs viewed none of "
                "its inputs",
                "report it, with the segment's code (TORCH_LOGS=output_code)",
            )
        del fallback
        self.pool_bytes += self.capturer.pool_bytes(before)
        return originals

    def _turn_off(
        self, rec: _Recording, fallback: list[Any], explanation: str, hint: str
    ) -> list[Any]:
        """The capture into ``rec`` is unusable: the segment is off for good and this
        call runs uncaptured on ``fallback`` (its inputs)."""
        rec.graph = None
        self._hot = None
        self._off = self._skip(CudagraphRefusalKind.CAPTURE_FAILED, explanation, hint)
        self.uncaptured_calls += 1
        return list(self.fn(fallback))

    def _install(
        self,
        rec: _Recording,
        originals: list[Any],
        in_place: set[int],
        views: dict[int, list[int]],
        alternate: bool,
    ) -> None:
        """Make a captured recording the one its shape replays: its replay callable,
        output twins and watches, its pool's reuse bookkeeping, the counts."""
        table, pool = rec.table, rec.pool
        rec.replay = self.capturer.replayer(rec.graph)
        table.made += 0 if alternate else 1
        table.buffers += 1
        self._finish(rec, originals, in_place)
        # NOTE: the twins do not own their memory, the graph does: if the
        # recording goes while an output it handed out is held, keep the graph.
        weakref.finalize(rec, adopt_if_held, rec.graph, rec.watch)
        rec.reuse = pool.reusable(views)
        _hand_out_aliases(pool, rec.reuse)
        pool.add(rec)
        table.recordings.append(rec)
        table.last = rec
        if not self._dynamic:
            self._hot = rec
        log.debug(
            "cudagraph: %s recorded (%d for this shape, %d earlier outputs' memory reusable)",
            self.spec.name,
            table.made,
            len(rec.reuse),
        )
        if self.listener is not None:
            self.listener(self.stats(), "recorded")

    def _finish(self, rec: _Recording, originals: list[Any], in_place: set[int]) -> None:
        """Keep the capture's outputs as non-owning twins (the call hands out the
        originals), and watch every storage the recording hands out."""
        table = rec.table
        groups: dict[int, list[int]] = {}
        for p, o in enumerate(originals):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                cdata = storage_id(o)
                if cdata not in in_place:
                    groups.setdefault(cdata, []).append(p)
        outs = list(originals)
        # NOTE: an in-place input passed through is handed out from the call's own
        # inputs: kept here, a forward's output read in place by a backward would
        # stay alive, and the forward's recording would count it as held for good.
        rec.through = tuple((p, i) for p, i in self.spec.passthrough if i in rec.inplace_idx)
        for p, _ in rec.through:
            outs[p] = None
        twins: dict[int, torch.UntypedStorage] = {}
        twinned: set[int] = set()
        # NOTE: an output that is a static input buffer (a passthrough) is that
        # buffer's memory, not the pool's: watched, never twinned.
        buffers = {storage_id(b) for b in rec.bufs}
        for cdata, ps in groups.items():
            if cdata not in buffers and all(_aliasable(originals[p]) for p in ps):
                for p in ps:
                    outs[p] = non_owning_alias(originals[p], twins)
                twinned.add(cdata)
        # NOTE: the twins' Python storages count as uses; drop them before the
        # baselines are read.
        twins.clear()
        rec.outputs = outs
        escaping = self.spec.escaping_outputs
        rec.clone_idx = tuple(sorted(p for p in table.copy_out if p < len(outs)))
        rec.alias_idx = tuple(
            sorted(
                p
                for p in escaping
                if p < len(outs) and p not in table.copy_out and isinstance(outs[p], torch.Tensor)
            )
        )
        watch = []
        for cdata, ps in groups.items():
            if set(ps) <= table.copy_out:
                continue
            first = outs[ps[0]]
            keep = tuple(outs[p] for p in ps)
            if cdata in twinned:
                w = Watch(storage_id(first), 0, tuple(ps), keep, _memory(first), owned=False)
                w.origin = storage_weak_ref(originals[ps[0]])
            else:
                w = Watch(cdata, 0, tuple(ps), keep, _memory(first))
            watch.append(w)
        for w in watch:
            w.baseline = storage_use_count(w.cdata)
        rec.watch = watch
        rec.managed = [_memory(outs[ps[0]]) for ps in groups.values()]
        _manage(rec.managed, +1)
        # NOTE: a dead recording's memory may be reused at the same address;
        # forget it as managed when the recording goes.
        weakref.finalize(rec, _forget, rec.managed)

    def _decline(self, table: _Table, last: _Recording, inputs: list[Any]) -> None:
        """Give up this shape: its static inputs moved with their storage before every
        replay, so each recording would be used once (a capture per call, and its pool
        held besides the memory of the uncaptured run once the budget is spent). Its
        recordings go (their memory back to the allocator) and the calls run uncaptured."""
        table.declined = True
        for rec in list(table.recordings):
            rec.pool.retire(rec, rec.pool.held(rec))
        moved = _moved(last, inputs)
        i = moved[0]
        names = ", ".join(self.spec.input_names[k] for k in moved[:4])
        more = f" and {len(moved) - 4} more" if len(moved) > 4 else ""
        self._skip(
            CudagraphRefusalKind.INPUT_REALLOCATED,
            f"static inputs {names}{more} got new memory on each of the last "
            f"{REALLOCATED_CHAIN + 1} calls (the same storage freed and allocated again, as "
            "FSDP2 does with its unsharded parameters), so no recording replayed twice; "
            "this segment now runs uncaptured and its recordings' memory is released",
            "capture the whole training step with torchloom.capture_step (FSDP2's "
            "all-gathers inside the graph), or keep these tensors' storage allocated",
            where=self.spec.input_sources[i],
        )

    def _warn_budget(self, table: _Table, inputs: list[Any]) -> None:
        last = table.last or (table.recordings[-1] if table.recordings else None)
        moved = []
        if last is not None:
            for i in sorted(set(last.inplace_idx) - set(last.stable_idx)):
                new = inputs[i].data_ptr() if isinstance(inputs[i], torch.Tensor) else None
                if new != last.ptrs[i]:
                    moved.append(i)
        opts = self.spec.options
        if moved:
            i = moved[0]
            old = last.ptrs[i] if last is not None else None
            explanation = (
                f"static input {self.spec.input_names[i]} changed its data pointer from "
                f"{_hex(old)} to {_hex(inputs[i].data_ptr())} after {table.made} recordings "
                f"(cudagraph_max_recording={opts.max_recording}); this segment now runs uncaptured"
            )
            where = self.spec.input_sources[i]
        else:
            explanation = (
                f"outputs were held across calls {table.retires} times "
                f"(cudagraph_max_recording={opts.max_recording}); this segment now runs uncaptured"
            )
            where = ""
        self._skip(
            CudagraphRefusalKind.RECORDING_BUDGET,
            explanation,
            "update parameters in place (p.copy_(new)) instead of assigning new tensors, "
            "or raise cudagraph_max_recording",
            where=where,
        )

    def _skip(
        self, kind: CudagraphRefusalKind, explanation: str, hint: str, where: str = ""
    ) -> Unsupported:
        reason = Unsupported(kind, where or self.spec.name, explanation, hint)
        if self.listener is not None:
            self.listener(self.stats(), str(reason))
        report_skip(reason, self.spec.name, self.spec.options)
        return reason

    def release(self) -> None:
        """Drop every recording: their CUDA graphs, static buffers and outputs, so
        the memory pool they hold can go back to the device once nothing else
        holds it. The next call of a shape warms up and records again (counters
        and the report keep what happened so far).

        ``torch._dynamo.reset()`` calls this through the backend, as it resets
        Inductor's CUDA graph trees: Dynamo keeps the compiled functions of the
        frames it compiled (as globals of their modules), so without it the
        graphs of every compiled function would live until the process ends.
        """
        for table in self._tables.values():
            for rec in list(table.recordings):
                # NOTE: retired through its pool, as when its outputs are held: a
                # held output becomes an orphan that keeps its graph (and the
                # memory it views) until it dies; the others' graphs go with them.
                rec.pool.retire(rec, rec.pool.held(rec))
            self._released += table.buffers
        self._tables.clear()
        self._hot = None

    # --- report ----------------------------------------------------------------------------

    def stats(self) -> SegmentStats:
        made = self._released + sum(t.buffers for t in self._tables.values())
        copied = sorted(
            set().union(*(t.copy_out for t in self._tables.values())) if self._tables else ()
        )
        reasons = (self._off,) if self._off is not None else ()
        return SegmentStats(
            name=self.spec.name,
            captured=self._off is None,
            reasons=reasons,
            nodes=self.spec.nodes,
            recordings=made,
            shapes=len(self._tables),
            replays=self.replays,
            uncaptured_calls=self.uncaptured_calls,
            pool_bytes=self.pool_bytes,
            copied_out=tuple(copied),
        )


def _hand_out_aliases(pool: MemoryPool, reuse: list[Reuse]) -> None:
    """Earlier recordings hand out a fresh alias of each output that a new recording
    consumes and reuses the memory of, from now on.

    The new recording replays only while such an output is held by its argument
    list alone (one reference, one use of the storage above the baseline); the
    twin object itself, which an intermediate output is handed out as, is held
    by its recording too, so every replay would count as held."""
    for w, positions in reuse:
        if not positions:
            continue
        for q in pool.recordings:
            if isinstance(q, _Recording) and w in q.watch:
                q.alias_idx = tuple(sorted({*q.alias_idx, *w.positions} - set(q.clone_idx)))


def _usable(rec: _Recording, inputs: list[Any]) -> bool:
    """Whether ``rec`` may replay for ``inputs`` (see ``MemoryPool``)."""
    pool = rec.pool
    return not pool.blocked(rec) and (not rec.reuse or pool.reuse_free(rec.reuse, inputs))


def _storage(v: Any) -> int | None:
    """``storage_id`` of a strided tensor with memory, else ``None``."""
    if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type != "meta":
        return storage_id(v)
    return None


def _aliased_inputs(
    warm: Sequence[tuple[int, StorageWeakRef] | None], outs: Sequence[Any]
) -> frozenset[int]:
    """The input positions whose storage an output shares (a view or the input itself).

    ``warm`` holds the inputs' storages weakly, which keeps their addresses from
    going to a tensor the call made after freeing an input."""
    storages = {_storage(o) for o in outs}
    return frozenset(i for i, w in enumerate(warm) if w is not None and w[0] in storages)


def _same_storage(warm: tuple[int, StorageWeakRef] | None, v: torch.Tensor) -> bool:
    """Whether ``v`` is over the warm-up input's storage itself (alive, same identity).

    An address alone is no evidence: a backward's incoming gradient is a fresh
    tensor every step, and the allocator often (not always) places it where the
    warm-up's was; read in place, the next step's gradient elsewhere would make
    the segment record again, into a pool of its own."""
    return warm is not None and not warm[1].expired() and storage_id(v) == warm[0]


def _moved(rec: _Recording, inputs: list[Any]) -> list[int]:
    """The in-place input positions of ``rec`` whose address differs in ``inputs``."""
    return [i for i in rec.inplace_idx if inputs[i].data_ptr() != rec.ptrs[i]]


def _superseded(table: _Table, inputs: list[Any]) -> _Recording | None:
    """The latest recording whose in-place inputs that moved are, every one, the
    storage it recorded at another address (resized away and back), or ``None``."""
    for rec in reversed(table.recordings):
        moved = _moved(rec, inputs)
        if moved and all(
            rec.storages.get(i) is not None and _storage(inputs[i]) == rec.storages[i]
            for i in moved
        ):
            return rec
    return None


def _stable_input_moved(table: _Table, inputs: list[Any]) -> bool:
    """Whether an input that a recording uses in place for its stable address moved."""
    return any(
        inputs[i].data_ptr() != rec.ptrs[i] for rec in table.recordings for i in rec.stable_idx
    )


def _hex(ptr: int | None) -> str:
    return "None" if ptr is None else hex(ptr)


def _shapes(inputs: list[Any]) -> str:
    return ", ".join(str(tuple(v.shape)) for v in inputs if isinstance(v, torch.Tensor))
