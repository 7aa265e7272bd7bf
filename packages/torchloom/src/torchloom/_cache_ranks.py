"""The ranks of a distributed job agreeing whether loom's cache serves a graph.

Invariant: under ``torch.distributed`` with more than one rank (and the option
``cache_agree`` on, the default), a graph is served from the cache on every rank or
on none. Without it a rank served in a second runs ahead to its first collective and
waits there while another rank compiles for minutes, towards NCCL's timeout. Before
serving, the ranks agree with one ``all_reduce`` (MIN) of three host integers over a
gloo group made once per process (:data:`AGREE_TIMEOUT`): the lowest rank that
missed (the world size when none did), and a hash of the key taken from both ends,
which tells whether the ranks are looking up the same graph. A rank whose lookup
hit while another's missed compiles too, and stores the same entry again.

Assumption: every rank compiles the same graphs in the same order, as under DDP and
FSDP2, where every rank runs the same program (Dynamo's DDP optimizer splits the
same buckets on every rank). A graph that bypasses the cache takes part as a miss,
so a key that fails on one rank keeps the ranks paired; with the cache off nothing
is agreed. Where the assumption does not hold (pipeline stages, rank-dependent
code, a graph compiled on some ranks only), turn the agreement off with
``TORCHLOOM_CACHE_AGREE=0`` or ``options={"cache_agree": False}``. Ranks found
looking up different keys are warned about once; an agreement that fails (a timeout,
a rank gone) turns agreement off for the process with a warning, and each rank then
decides alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

import loom_cache
from torchloom._cache import CacheLookup
from torchloom._report import GraphRecordBuilder

__all__ = [
    "AGREE_TIMEOUT",
    "Agreed",
    "CacheAgreement",
    "agree_on_bypass",
    "agree_on_lookup",
    "agree_or_decide_alone",
    "cache_agreement",
]

log = logging.getLogger("torchloom.cache")

#: How long one rank waits in an agreement for the others: they arrive as far apart
#: as their compiles of the previous graphs took (a cold Inductor compile of a large
#: graph takes minutes); PyTorch's default for gloo groups.
AGREE_TIMEOUT: Final = datetime.timedelta(minutes=30)

#: The key's hash sent in an agreement: 60 bits, so that its negation fits in int64.
_HASH_HEX_DIGITS: Final = 15

#: ``all_reduce`` (MIN) of a few host integers over the ranks.
MinReduce = Callable[[Sequence[int]], Sequence[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class Agreed:
    """What the ranks agreed on for one lookup."""

    #: Every rank's lookup hit: serve it.
    hit: bool
    #: Which rank missed (``None``: none did), for the report and the miss reason.
    missed_rank: int | None
    #: Whether the ranks looked up the same key.
    same_key: bool

    def describe(self, ranks: int) -> str:
        if self.hit:
            return f"all {ranks} ranks hit: every rank serves the graph"
        return f"rank {self.missed_rank} missed: every rank compiles the graph"


class CacheAgreement:
    """The ranks of one job agreeing on each lookup: :meth:`agree` is one collective
    call (every rank calls it once per keyed compile, in the same order)."""

    def __init__(self, rank: int, ranks: int, reduce_min: MinReduce) -> None:
        self.rank = rank
        self.ranks = ranks
        self._reduce_min = reduce_min
        #: lookups agreed so far
        self.calls = 0
        self._warned_keys = False

    def agree(self, digest: str | None, hit: bool) -> Agreed:
        """The agreed outcome of this rank's lookup of ``digest`` (``None``: the graph
        bypasses the cache, a miss); raises what the collective raised."""
        self.calls += 1
        key_hash = int(digest[:_HASH_HEX_DIGITS], 16) if digest is not None else 0
        proposal = (self.ranks if hit else self.rank, key_hash, -key_hash)
        first_miss, low, neg_high = self._reduce_min(proposal)
        same_key = low == -neg_high
        if not same_key and not self._warned_keys:
            self._warned_keys = True
            log.warning(
                "torchloom: the ranks looked up different cache keys at the same compile "
                "(agreement %d): the cache agreement assumes every rank compiles the same "
                "graphs in the same order (DDP, FSDP2); where they do not, set "
                "TORCHLOOM_CACHE_AGREE=0",
                self.calls,
            )
        missed = None if first_miss >= self.ranks else int(first_miss)
        return Agreed(missed is None, missed, same_key)


#: The process's agreement and the default group it was made for (a new
#: ``init_process_group`` makes a new one); ``None`` for the agreement: turned off
#: after a failed agreement.
_agreement: tuple[Any, CacheAgreement | None] | None = None


def cache_agreement(enabled: bool) -> CacheAgreement | None:
    """The process's :class:`CacheAgreement`, or ``None``: ``enabled`` off,
    torch.distributed not initialized, one rank, or an earlier agreement failed.
    The first call makes a gloo group over the default group's ranks (a collective
    call: every rank makes it at its first keyed compile)."""
    global _agreement
    if not enabled:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    if _agreement is None or _agreement[0] is not world:
        group = dist.new_group(backend="gloo", timeout=AGREE_TIMEOUT)
        agreement = CacheAgreement(
            dist.get_rank(), dist.get_world_size(), lambda values: _gloo_min(values, group)
        )
        _agreement = (world, agreement)
    return _agreement[1]


def agree_or_decide_alone(
    agreement: CacheAgreement, digest: str | None, hit: bool
) -> Agreed | None:
    """:meth:`CacheAgreement.agree`, or ``None`` when the collective failed: then the
    process stops agreeing (the ranks are out of step) and each rank decides alone."""
    global _agreement
    try:
        return agreement.agree(digest, hit)
    # NOTE: what a failed collective raises: torch.distributed's errors (DistError and
    # its kinds are RuntimeErrors, as gloo's timeouts are) and socket errors; anything
    # else is a bug of loom's and propagates.
    except (RuntimeError, OSError) as err:
        if _agreement is not None and _agreement[1] is agreement:
            _agreement = (_agreement[0], None)
        log.warning(
            "torchloom: rank %d could not agree with the other ranks on a cache lookup "
            "(%s: %s); each rank now decides alone whether the cache serves a graph",
            agreement.rank,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None


#: Key components that name the rank's own device (``cuda:<index>`` in the input
#: metadata, the value metadata, device arguments of constants). The ``graph``
#: component's digest does too (device arguments of its calls): its detail, the
#: graph's size, is compared instead.
_DEVICE_BOUND: Final = frozenset({"inputs", "values", "constants"})


def rank_neutral_digest(key: loom_cache.CacheKey) -> str:
    """What the ranks compare to tell whether they compile the same graph: the key
    without its device-bound components, with the program and the graph's size.

    NOTE: each rank drives its own GPU, and the generated code names its device
    index, so the key itself must differ by rank (an entry compiled for ``cuda:1``
    cannot serve ``cuda:0``). Compared whole, every multi-GPU job would look like
    ranks compiling different graphs. Without those components the comparison
    still tells a different program, graph size, option, version or environment.
    """
    kept = sorted(
        (c.name, c.detail if c.name == "graph" else c.digest)
        for c in key.components
        if c.name not in _DEVICE_BOUND
    )
    return loom_cache.stable_digest((key.program, kept))


def agree_on_lookup(
    record: GraphRecordBuilder, agreement: CacheAgreement, lookup: CacheLookup
) -> CacheLookup:
    """This rank's ``lookup`` as the ranks agreed on it: a hit that another rank
    missed becomes a miss saying so."""
    hit = lookup.artifact is not None
    agreed = _agree(record, agreement, rank_neutral_digest(lookup.key), hit)
    if agreed is None or agreed.hit or not hit:
        return lookup
    reason = (
        f"a hit on this rank, but rank {agreed.missed_rank} missed, so every rank "
        "compiles (cache_agree)"
    )
    log.info("graph %d: %s", record.graph_id, reason)
    return dataclasses.replace(lookup, artifact=None, reason=reason)


def agree_on_bypass(record: GraphRecordBuilder, agreement: CacheAgreement) -> None:
    """A graph that bypasses the cache takes part in the agreement as a miss, so
    that the ranks stay paired should another rank have a key for it."""
    _agree(record, agreement, None, False)


def _agree(
    record: GraphRecordBuilder, agreement: CacheAgreement, digest: str | None, hit: bool
) -> Agreed | None:
    """One agreement, recorded in the report (area ``cache``, kind ``agreed``)."""
    with record.timed("cache.agree"):
        agreed = agree_or_decide_alone(agreement, digest, hit)
    if agreed is None:
        record.add_entry(
            "cache",
            "agreed",
            "the ranks could not agree: this rank decides alone",
            rank=agreement.rank,
        )
        return None
    record.add_entry(
        "cache",
        "agreed",
        agreed.describe(agreement.ranks),
        rank=agreement.rank,
        ranks=agreement.ranks,
        missed_rank=agreed.missed_rank,
        same_key=agreed.same_key,
    )
    return agreed


def _gloo_min(values: Sequence[int], group: Any) -> list[int]:
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t]
