"""Local tier first, remote tier second; the remote tier can never fail a compile.

A lookup that misses locally asks the remote tier and copies a remote hit
into the local tier, but only an entry whose signature this process verified
(or any entry when no key is set at all): an entry the remote tier served on
``remote_trust="unsigned"`` is never re-signed into the local tier. When the
remote tier is down or slow (every call has one overall deadline) the store
logs one warning and a circuit breaker skips the remote tier for
``retry_after_s`` seconds (``TORCHLOOM_REMOTE_CACHE_RETRY_AFTER``); the first
call after that probes it again. Any exception out of the remote tier counts as
such a failure, whatever its type: nothing the remote tier raises reaches the
caller. One kind is narrower: a write the remote tier refused
(:class:`CommandRefused`, e.g. a full Redis answering ``OOM``) pauses the
remote tier's writes for as long, with one warning, and its reads go on: a
full server still serves what it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from loom_cache._config import CacheConfig
from loom_cache._entry import Entry
from loom_cache._local import LocalStore
from loom_cache._store import (
    CommandRefused,
    EntryInfo,
    Lookup,
    PutResult,
    Store,
    StoreUnavailable,
)

log = logging.getLogger("torchloom.cache")


class TieredStore:
    """``LocalStore`` in front of an optional remote store (e.g. ``RedisStore``)."""

    name = "tiered"

    def __init__(
        self,
        local: LocalStore,
        remote: Store | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.retry_after_s = (
            retry_after_s if retry_after_s is not None else local.config.remote_retry_after_s
        )
        self._down_until = 0.0
        self._writes_down_until = 0.0
        self._warned = False
        self._warned_writes = False
        self.remote_errors = 0
        #: Why there is no remote tier although a URL is set (None: there is one, or
        #: no URL); ``torchloom cache stats`` shows it.
        self.remote_off: str | None = None

    def _remote_usable(self) -> bool:
        return self.remote is not None and time.monotonic() >= self._down_until

    def _remote_writable(self) -> bool:
        return self._remote_usable() and time.monotonic() >= self._writes_down_until

    def _write_refused(self, exc: CommandRefused) -> None:
        self.remote_errors += 1
        self._writes_down_until = time.monotonic() + self.retry_after_s
        if not self._warned_writes:
            self._warned_writes = True
            log.warning(
                "loom cache: the remote tier refused a write, so it stores nothing for "
                "%g s and still serves its entries: %s",
                self.retry_after_s,
                exc,
            )
        else:
            log.debug("loom cache: the remote tier still refuses writes: %s", exc)

    def _remote_failed(self, exc: Exception) -> None:
        if not isinstance(exc, StoreUnavailable):  # a store other than RedisStore
            exc = StoreUnavailable(f"{getattr(self.remote, 'name', 'remote')}: {exc!r}")
        self.remote_errors += 1
        self._down_until = time.monotonic() + self.retry_after_s
        if not self._warned:
            self._warned = True
            log.warning("loom cache: remote tier unavailable, using the local tier only: %s", exc)
        else:
            log.debug("loom cache: remote tier still unavailable: %s", exc)

    def lookup(self, digest: str) -> Lookup:
        local = self.local.lookup(digest)
        if local.hit or not self._remote_usable():
            return local
        assert self.remote is not None
        try:
            remote = self.remote.lookup(digest)
        except Exception as exc:  # NOTE: the remote tier can never fail a compile
            self._remote_failed(exc)
            return Lookup(None, self.local.name, f"{local.reason}; remote unavailable")
        if remote.entry is not None:
            if remote.verified or not self.local.config.signing:
                self.local.put(remote.entry)
            return remote
        return Lookup(None, remote.tier, f"{local.reason} locally, {remote.reason} remotely")

    def put(self, entry: Entry) -> PutResult:
        """Stored when any tier stored it; otherwise the local tier's reason."""
        local = self.local.put(entry)
        if self._remote_writable():
            assert self.remote is not None
            try:
                remote = self.remote.put(entry)
            except CommandRefused as exc:
                self._write_refused(exc)
            except Exception as exc:
                self._remote_failed(exc)
            else:
                if remote.stored and not local.stored:
                    return PutResult(True, remote.tier, f"stored remotely only ({local.reason})")
        return local

    def delete(self, digest: str) -> bool:
        removed = self.local.delete(digest)
        if self._remote_usable():
            assert self.remote is not None
            try:
                removed = self.remote.delete(digest) or removed
            except Exception as exc:
                self._remote_failed(exc)
        return removed

    def entries(self) -> Iterator[EntryInfo]:
        yield from self.local.entries()

    def clear(self) -> int:
        removed = self.local.clear()
        if self._remote_usable():
            assert self.remote is not None
            try:
                removed += self.remote.clear()
            except Exception as exc:
                self._remote_failed(exc)
        return removed


def open_default_store(config: CacheConfig | None = None) -> TieredStore:
    """The tiered store ``config`` describes (default: :meth:`CacheConfig.from_env`):
    the local store, plus Redis when a remote URL is set and its entries can be
    trusted (a key is set, or ``remote_trust="unsigned"``; otherwise the remote
    tier is off, as the configuration warned; and off when a configured key file
    is missing). An unusable URL only warns."""
    return open_store(config)


def open_store(config: CacheConfig | None = None, *, create: bool = True) -> TieredStore:
    """:func:`open_default_store`; ``create=False`` leaves a missing directory missing
    (``torchloom cache stats`` and the other read-only commands)."""
    config = config if config is not None else CacheConfig.from_env()
    remote, off = _remote_tier(config)
    store = TieredStore(LocalStore(config=config, create=create), remote)
    store.remote_off = off
    return store


def _remote_tier(config: CacheConfig) -> tuple[Store | None, str | None]:
    """The remote tier ``config`` describes, or None and why it is off (None: no URL).
    An unusable URL warns here; an untrusted tier and a missing key file warned when
    the configuration was resolved."""
    from loom_cache._config import redact, redact_url, url_problem
    from loom_cache._redis import RedisStore

    url = config.remote_url
    if not url:
        return None, None
    problem = url_problem(url)
    if problem is None:
        if config.key_missing is not None:
            return None, f"fail closed: {config.key_missing}"
        if config.remote_requires_signature and not config.signing:
            return (
                None,
                "no cache key is set and it serves only signed entries (docs/cache.md, Trust)",
            )
        try:
            return RedisStore(url, config=config), None
        except (StoreUnavailable, ValueError, TypeError) as exc:
            problem = redact(str(exc), url)
    log.warning("loom cache: ignoring TORCHLOOM_REMOTE_CACHE=%s: %s", redact_url(url), problem)
    return None, f"unusable URL: {problem}"
