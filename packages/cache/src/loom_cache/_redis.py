"""A Redis tier shared by a fleet (``TORCHLOOM_REMOTE_CACHE=redis://host:port/db``).

Every call has a bounded socket timeout; any failure surfaces as
:class:`StoreUnavailable` so the tiered store can go on with the local tier.
Entries use the same encoding as the local store and expire after
``ttl_seconds`` (Redis' own ``maxmemory`` policy bounds the size). The URL
enters messages only redacted (``redis://user:***@host``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Final

from loom_cache._config import redact, redact_url, timeout_from_env
from loom_cache._entry import Entry, EntryError, decode_entry, decode_header, encode_entry
from loom_cache._key import CacheKey
from loom_cache._store import EntryInfo, Lookup, PutResult, StoreUnavailable

PREFIX: Final = "torchloom:v1:"
DEFAULT_TTL_S: Final = 14 * 24 * 3600


def remote_url_from_env() -> str | None:
    return os.environ.get("TORCHLOOM_REMOTE_CACHE") or None


class RedisStore:
    """Entries in Redis under ``torchloom:v1:<digest>``.

    Needs the ``redis`` extra (``pip install torchloom-cache[redis]``).
    """

    name = "redis"

    def __init__(self, url: str, *, timeout_s: float | None = None, ttl_s: int = DEFAULT_TTL_S):
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise StoreUnavailable(
                "the remote cache needs the `redis` package (torchloom-cache[redis])"
            ) from exc
        self.url = url
        self.timeout_s = timeout_s if timeout_s is not None else timeout_from_env()
        self.ttl_s = ttl_s
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except self._errors as exc:
            message = redact(f"{type(exc).__name__}: {exc}", self.url)
            raise StoreUnavailable(f"redis at {redact_url(self.url)}: {message}") from None

    def lookup(self, digest: str) -> Lookup:
        data = self._call("get", PREFIX + digest)
        if data is None:
            return Lookup(None, self.name, "absent")
        try:
            entry = decode_entry(bytes(data), expected_digest=digest)
        except EntryError as exc:
            self._call("delete", PREFIX + digest)
            return Lookup(None, self.name, f"corrupt entry: {exc}")
        return Lookup(entry, self.name, "hit")

    def put(self, entry: Entry) -> PutResult:
        self._call("set", PREFIX + entry.digest, encode_entry(entry), ex=self.ttl_s)
        return PutResult(True, self.name, "stored")

    def put_raw(self, digest: str, data: bytes) -> None:
        """Store bytes as they are (tests use it to plant corrupt entries)."""
        self._call("set", PREFIX + digest, data, ex=self.ttl_s)

    def delete(self, digest: str) -> bool:
        return bool(self._call("delete", PREFIX + digest))

    def _keys(self) -> list[Any]:
        keys: list[Any] = []
        cursor = 0
        while True:
            cursor, batch = self._call("scan", cursor, match=PREFIX + "*", count=500)
            keys.extend(batch)
            if int(cursor) == 0:
                return keys

    def entries(self) -> Iterator[EntryInfo]:
        for raw_key in self._keys():
            data = self._call("get", raw_key)
            if data is None:
                continue
            try:
                header, _ = decode_header(bytes(data))
                key = CacheKey.from_json(header["key"])
            except (EntryError, KeyError, TypeError, ValueError):
                continue
            created = float(header.get("created", 0.0))
            yield EntryInfo(key, len(data), created, created)

    def clear(self) -> int:
        removed = 0
        for raw_key in self._keys():
            removed += int(self._call("delete", raw_key))
        return removed
