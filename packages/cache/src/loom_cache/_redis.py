"""The fleet tier: entries in Redis (``TORCHLOOM_REMOTE_CACHE=redis://host:port/db``).

Bounded waits: every call has one overall deadline (``remote_timeout_s``)
covering connect, send and receive together. redis-py's own socket timeouts
bound each socket operation; on top of them, the connection's socket is
wrapped so that each read and write may only wait for what is left of the
call's deadline, so a server that drips one byte at a time cannot stretch a
call past it. Retries are off. Any failure surfaces as
:class:`StoreUnavailable` so the tiered store can go on with the local tier.

Trust: with a key set (``TORCHLOOM_CACHE_KEY``) entries are written signed and
only entries whose HMAC checks out are served; without one, the tier serves
unsigned entries only when ``remote_trust="unsigned"`` was chosen. Keys live
under ``torchloom:v1:<namespace>:<digest>`` and an entry records its
namespace, so tenants sharing a server never see each other's entries.
Entries expire after ``ttl_seconds`` (Redis' own ``maxmemory`` policy bounds
the size). The URL enters messages only redacted (``redis://user:***@host``).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

from loom_cache._config import CacheConfig, redact, redact_url
from loom_cache._entry import Entry, EntryError, decode_checked, decode_header, encode_entry
from loom_cache._key import CacheKey
from loom_cache._store import EntryInfo, Lookup, PutResult, StoreUnavailable

PREFIX: Final = "torchloom:v1:"
DEFAULT_TTL_S: Final = 14 * 24 * 3600


class Deadline(threading.local):
    """The monotonic time the current call must end by (per thread), or None."""

    at: float | None = None

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()


class DeadlineSocket:
    """A socket whose reads and writes wait at most for what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._timeout = sock.gettimeout()

    def _bound(self) -> None:
        left = self._deadline.remaining()
        if left is None:
            self._sock.settimeout(self._timeout)
            return
        if left <= 0:
            raise TimeoutError("loom cache: the remote call's deadline passed")
        self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, *args: Any) -> bytes:
        self._bound()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._bound()
        return self._sock.recv_into(*args)

    def sendall(self, data: Any, *args: Any) -> None:
        self._bound()
        self._sock.sendall(data, *args)

    def send(self, data: Any, *args: Any) -> int:
        self._bound()
        return self._sock.send(data, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _connection_class(base: type[Any]) -> type[Any]:
    class DeadlineConnection(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, loom_deadline: Deadline, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._loom_deadline = loom_deadline
            self._loom_connect_timeout: float | None = kwargs.get("socket_connect_timeout")

        def _connect(self) -> Any:
            left = self._loom_deadline.remaining()
            if left is not None and left <= 0:
                raise TimeoutError("loom cache: the remote call's deadline passed")
            limit = self._loom_connect_timeout
            self.socket_connect_timeout = (
                left if limit is None else (limit if left is None else min(limit, left))
            )
            return DeadlineSocket(super()._connect(), self._loom_deadline)

    DeadlineConnection.__name__ = f"Deadline{base.__name__}"
    return DeadlineConnection


class RedisStore:
    """Entries in Redis under ``torchloom:v1:<namespace>:<digest>``.

    Needs the ``redis`` extra (``pip install torchloom-cache[redis]``).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float | None = None,
        ttl_s: int = DEFAULT_TTL_S,
        config: CacheConfig | None = None,
    ):
        try:
            import redis
            import redis.backoff
            import redis.connection
            import redis.retry
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise StoreUnavailable(
                "the remote cache needs the `redis` package (torchloom-cache[redis])"
            ) from exc
        config = config if config is not None else CacheConfig.from_env()
        if timeout_s is not None:
            config = dataclasses.replace(config, remote_timeout_s=timeout_s)
        self.config = config
        self.url = url
        self.timeout_s = config.remote_timeout_s
        self.ttl_s = ttl_s
        self.prefix = PREFIX + (f"{config.namespace}:" if config.namespace else "")
        self._deadline = Deadline()
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        scheme = url.split(":", 1)[0].lower()
        base: type[Any] = {
            "rediss": redis.connection.SSLConnection,
            "unix": redis.connection.UnixDomainSocketConnection,
        }.get(scheme, redis.connection.Connection)
        pool = redis.ConnectionPool.from_url(
            url,
            connection_class=_connection_class(base),
            loom_deadline=self._deadline,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry_on_timeout=False,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            health_check_interval=0,
        )
        self._client: Any = redis.Redis(
            connection_pool=pool, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)
        )

    @property
    def requires_signature(self) -> bool:
        return self.config.remote_requires_signature

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._deadline.at = time.monotonic() + self.timeout_s
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except self._errors as exc:
            message = redact(f"{type(exc).__name__}: {exc}", self.url)
            with_deadline = "" if "deadline" in message else f" (deadline {self.timeout_s} s)"
            raise StoreUnavailable(
                f"redis at {redact_url(self.url)}: {message}{with_deadline}"
            ) from None
        finally:
            self._deadline.at = None

    def lookup(self, digest: str) -> Lookup:
        data = self._call("get", self.prefix + digest)
        if data is None:
            return Lookup(None, self.name, "absent")
        try:
            entry, verified = decode_checked(
                bytes(data),
                digest,
                self.config.keys,
                self.requires_signature,
                self.config.namespace,
            )
        except EntryError as exc:
            self._call("delete", self.prefix + digest)
            return Lookup(None, self.name, f"corrupt entry: {exc}")
        return Lookup(entry, self.name, "hit", verified)

    def put(self, entry: Entry) -> PutResult:
        key = self.config.keys[0] if self.config.keys else None
        data = encode_entry(entry, key=key, namespace=self.config.namespace)
        self._call("set", self.prefix + entry.digest, data, ex=self.ttl_s)
        return PutResult(True, self.name, "stored")

    def put_raw(self, digest: str, data: bytes) -> None:
        """Store bytes as they are (tests use it to plant corrupt or forged entries)."""
        self._call("set", self.prefix + digest, data, ex=self.ttl_s)

    def delete(self, digest: str) -> bool:
        return bool(self._call("delete", self.prefix + digest))

    def _keys(self) -> list[Any]:
        keys: list[Any] = []
        cursor = 0
        digest_only = not self.config.namespace
        while True:
            cursor, batch = self._call("scan", cursor, match=self.prefix + "*", count=500)
            for raw in batch:
                rest = bytes(raw)[len(self.prefix) :]
                if digest_only and b":" in rest:
                    continue  # another namespace's entry
                keys.append(raw)
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
        """Remove every entry of this namespace (never another namespace's)."""
        removed = 0
        for raw_key in self._keys():
            removed += int(self._call("delete", raw_key))
        return removed

    def count(self) -> int:
        return len(self._keys())
