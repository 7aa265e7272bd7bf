"""What every artifact store offers, and the values stores return.

A store maps a key digest to an :class:`~loom_cache._entry.Entry`. Lookups
return a :class:`Lookup` that says where the entry came from or why there is
none (absent, corrupt, unreachable), so a miss always has a reason. A put
returns a :class:`PutResult` the same way: a store never raises for a local
problem (an unusable directory), it says why nothing was stored. A remote store
raises :class:`StoreUnavailable` when it cannot be reached, and its subclass
:class:`CommandRefused` when it answered with a refusal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from loom_cache._entry import Entry
from loom_cache._key import CacheKey


class StoreUnavailable(RuntimeError):
    """A store could not be reached in time (remote down or slow)."""


class CommandRefused(StoreUnavailable):
    """The store answered, but refused this command (a full Redis refusing a write
    with ``OOM``, a read-only replica, an ACL): the store is reachable, and a refused
    write does not stop its reads."""


@dataclass(frozen=True, slots=True)
class Lookup:
    """The result of a lookup: the entry, or ``None`` and the reason."""

    entry: Entry | None
    tier: str
    reason: str
    #: The entry's HMAC signature was checked with a key this process holds.
    verified: bool = False

    @property
    def hit(self) -> bool:
        return self.entry is not None


@dataclass(frozen=True, slots=True)
class PutResult:
    """The result of a put: whether the entry was stored, where, and if not, why."""

    stored: bool
    tier: str
    reason: str


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """A stored entry as listed (header only, no payload)."""

    key: CacheKey
    size: int
    created: float
    last_used: float
    meta: tuple[tuple[str, str], ...] = ()

    @property
    def digest(self) -> str:
        return self.key.digest


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    corrupt: int
    max_bytes: int | None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Store(Protocol):
    """A key-value store of cache entries."""

    name: str

    def lookup(self, digest: str) -> Lookup: ...

    def put(self, entry: Entry) -> PutResult: ...

    def delete(self, digest: str) -> bool: ...

    def entries(self) -> Iterator[EntryInfo]: ...

    def clear(self) -> int: ...
