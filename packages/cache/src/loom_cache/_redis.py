"""The fleet tier: entries in Redis (``TORCHLOOM_REMOTE_CACHE=redis://host:port/db``).

Bounded waits and bounded memory: every operation (a lookup, a put) has one
overall deadline (``remote_timeout_s``) covering connect, send, receive and
reply parsing, and every reply a byte budget. redis-py's own socket timeouts
bound each socket operation; on top of them the connection's socket is
wrapped so that each read and write may only wait for what is left of the
deadline, and a reply may only bring the bytes the call asked for (redis-py has
no reply-size limit of its own), so a server that drips bytes, or announces a
2 GB value, cannot stretch a lookup past the deadline or grow memory past the
budget. Values are read with ``GETRANGE`` in chunks; a large entry's payload
goes straight into one buffer sized from the entry's header (refused past
``remote_max_bytes``), which the entry then holds, uncopied. Retries are off.

Failures: any failure of a call, whatever its exception type, surfaces as
:class:`StoreUnavailable` (the tiered store then logs it and its circuit
breaker skips the tier), and the pool's idle connections are dropped so a
half-set-up connection is never reused. An error reply (redis-py's
``ResponseError``: ``OOM`` from a full server with ``noeviction``, ``READONLY``
from a replica, ``NOPERM``) means the server is there and refused that command:
:class:`CommandRefused`, so a refused write leaves reads on. A problem of one
key (a ``WRONGTYPE`` value, a corrupt, forged or oversized entry) is a miss for
that key only.

Trust: with a key set (``TORCHLOOM_CACHE_KEY``) entries are written signed and
only entries whose HMAC checks out are served; without one, the tier serves
unsigned entries only when ``remote_trust="unsigned"`` was chosen. An entry
the tier refuses warns once per process (later ones log at debug level). Keys
live under ``torchloom:v1:<namespace>:<digest>`` and an entry records its
namespace, so tenants sharing a server never see each other's entries.
Entries expire after ``ttl_seconds`` (Redis' own ``maxmemory`` policy bounds
the size). The URL enters messages only redacted (``redis://user:***@host``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

from loom_cache._config import CacheConfig, CacheConfigError, redact, redact_url, url_problem
from loom_cache._entry import (
    MAC_BYTES,
    Entry,
    EntryError,
    ForeignEntry,
    decode_checked,
    decode_header,
    decode_parts,
    encode_entry,
)
from loom_cache._key import CacheKey
from loom_cache._store import CommandRefused, EntryInfo, Lookup, PutResult, StoreUnavailable

log = logging.getLogger("torchloom.cache")

PREFIX: Final = "torchloom:v1:"
DEFAULT_TTL_S: Final = 14 * 24 * 3600
#: One ``GETRANGE`` reads at most this much (a value's first read holds its header).
#: redis-py's reply parsing holds about five times one reply while it reads it: 1 MiB
#: keeps a read at the value plus ~5 MiB (4 MiB chunks cost 0.84x more on 24 MiB).
CHUNK_BYTES: Final = 1 << 20
#: What a reply may bring beyond the bytes asked for (framing), and what a reply
#: that asks for no value (``SET``, ``DEL``, a ``SCAN`` page, the handshake) may bring.
_REPLY_SLACK: Final = 64 << 10
_SMALL_REPLY: Final = 1 << 20
_HEADER_READ: Final = 64 << 10
_warned_refusals: set[str] = set()


class ReplyTooLarge(Exception):
    """A reply brought more bytes than its call allows (not an ``OSError``, so that
    redis-py's reader passes it through unchanged)."""


class KeyRefused(Exception):
    """One key cannot be served (a ``WRONGTYPE`` value, an unexpected reply type, an
    entry past the read limit): a miss for that key, never for the tier."""


@dataclasses.dataclass(slots=True)
class _Value:
    """A value as read: ``whole`` (one read), or the parts of a chunked read."""

    whole: bytes | None = None
    head: bytes = b""
    payload: bytearray = dataclasses.field(default_factory=bytearray)
    trailer: bytes = b""


class Deadline(threading.local):
    """The monotonic time the current operation must end by, and the bytes its
    current call may still receive (per thread; None: unbounded)."""

    at: float | None = None
    budget: int | None = None
    limit: int = 0

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def charge(self, received: int) -> None:
        if self.budget is None:
            return
        self.budget -= received
        if self.budget < 0:
            raise ReplyTooLarge(
                f"the server sent more than {self.limit} bytes for one reply "
                "(see TORCHLOOM_REMOTE_CACHE_MAX_BYTES)"
            )


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
        data = self._sock.recv(*args)
        self._deadline.charge(len(data))
        return data

    def recv_into(self, *args: Any) -> int:
        self._bound()
        received = self._sock.recv_into(*args)
        self._deadline.charge(received)
        return received

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
        problem = url_problem(url)
        if problem is not None:
            raise CacheConfigError(f"the Redis URL {redact_url(url)} is unusable: {problem}")
        config = config if config is not None else CacheConfig.from_env()
        if timeout_s is not None:
            config = dataclasses.replace(config, remote_timeout_s=timeout_s)
        self.config = config
        self.url = url
        self.timeout_s = config.remote_timeout_s
        self.ttl_s = ttl_s
        self.prefix = PREFIX + (f"{config.namespace}:" if config.namespace else "")
        self._deadline = Deadline()
        self._response_error: type[Exception] = redis.ResponseError
        #: what a broken or hostile server makes redis-py raise: its own errors, and
        #: those of a handshake or parser that assume well-formed replies (``+OK`` to
        #: everything ends in AttributeError), and this store's reply budget
        self._server_faults: tuple[type[Exception], ...] = (
            redis.RedisError,
            OSError,
            ValueError,
            TypeError,
            AttributeError,
            IndexError,
            KeyError,
            ReplyTooLarge,
        )
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

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """One deadline for everything inside (the calls of one lookup share it)."""
        outer = self._deadline.at is None
        if outer:
            self._deadline.at = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            if outer:
                self._deadline.at = None

    def _call(self, method: str, *args: Any, reply_bytes: int = _SMALL_REPLY, **kwargs: Any) -> Any:
        with self._operation():
            self._deadline.budget = self._deadline.limit = reply_bytes
            try:
                return getattr(self._client, method)(*args, **kwargs)
            except self._response_error as exc:
                if str(exc).startswith("WRONGTYPE"):
                    raise KeyRefused(f"the key holds another type of value ({exc})") from None
                # NOTE: an error reply: the server is there and refused this command
                message = redact(f"{type(exc).__name__}: {exc}", self.url)
                raise CommandRefused(
                    f"redis at {redact_url(self.url)} refused {method.upper()}: {message}"
                ) from None
            except self._server_faults as exc:
                # NOTE: a hostile or broken server makes redis-py raise AttributeError,
                # ValueError, ... out of its handshake or parser; anything else is a
                # bug of ours and propagates.
                raise self._unavailable(exc) from None
            finally:
                self._deadline.budget = None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        # A connection that failed mid-handshake or mid-reply is back in the pool,
        # half set up: drop the idle ones so the next call starts afresh.
        with contextlib.suppress(Exception):
            self._client.connection_pool.disconnect(inuse_connections=False)
        message = redact(f"{type(exc).__name__}: {exc}", self.url)
        with_deadline = "" if "deadline" in message else f" (deadline {self.timeout_s} s)"
        return StoreUnavailable(f"redis at {redact_url(self.url)}: {message}{with_deadline}")

    def _refused(self, digest: str, why: str) -> None:
        """An entry this tier would not serve: a WARNING once per process and server."""
        where = redact_url(self.url)
        if where in _warned_refusals:
            log.debug(
                "loom cache: the remote tier %s refused entry %s: %s", where, digest[:12], why
            )
            return
        _warned_refusals.add(where)
        log.warning(
            "loom cache: the remote tier %s refused entry %s: %s. On a shared server this "
            "may be someone planting entries; further refusals are logged at debug level",
            where,
            digest[:12],
            why,
        )

    def _getrange(self, key: Any, start: int, length: int) -> bytes:
        data = self._call(
            "getrange", key, start, start + length - 1, reply_bytes=length + _REPLY_SLACK
        )
        if not isinstance(data, bytes):
            raise KeyRefused(f"the server answered GETRANGE with {type(data).__name__}")
        return data

    def _read(self, key: Any) -> _Value | None:
        """The value at ``key`` (None: absent).

        The first read (at most :data:`CHUNK_BYTES`) holds the entry's header; a larger
        value is sized from it, refused past ``remote_max_bytes``, and its payload read
        in chunks straight into one buffer of the payload's size, which becomes the
        entry's payload: memory is the value once, plus one chunk."""
        limit = self.config.remote_max_bytes
        first_len = min(CHUNK_BYTES, limit)
        first = self._getrange(key, 0, first_len)
        if len(first) < first_len:
            return _Value(whole=first) if first else None
        try:
            header, offset = decode_header(first)
            size = int(header["payload_bytes"])
            trailer = MAC_BYTES if header.get("signed_by") else 0
        except (EntryError, KeyError, TypeError, ValueError):
            return _Value(whole=first)  # decoding says what is wrong with it
        total = offset + size + trailer
        if total > limit:
            raise KeyRefused(
                f"entry of {total} bytes exceeds the remote read limit of {limit} bytes "
                "(raise TORCHLOOM_REMOTE_CACHE_MAX_BYTES to read it)"
            )
        if total <= len(first) or size < 0:
            return _Value(whole=first)
        head = first[:offset]
        payload = bytearray(size)
        tail = bytearray()
        pos = offset  # where the next part starts in the value
        part = memoryview(first)[offset:]  # NOTE: views: a slice of bytes is a copy
        while True:
            in_payload = max(0, min(len(part), offset + size - pos))
            payload[pos - offset : pos - offset + in_payload] = part[:in_payload]
            tail += part[in_payload : total - pos]
            pos += len(part)
            if pos >= total:
                break
            part = memoryview(self._getrange(key, pos, min(CHUNK_BYTES, total - pos)))
            if not part:
                break  # shorter than its header says: decoding refuses it
        if pos < offset + size:
            del payload[pos - offset :]
        return _Value(head=head, payload=payload, trailer=bytes(tail))

    def lookup(self, digest: str) -> Lookup:
        key = self.prefix + digest
        with self._operation():
            try:
                value = self._read(key)
            except KeyRefused as exc:
                self._refused(digest, str(exc))
                return Lookup(None, self.name, f"refused: {exc}")
            if value is None:
                return Lookup(None, self.name, "absent")
            config = self.config
            checks = (digest, config.keys, self.requires_signature, config.namespace)
            try:
                if value.whole is not None:
                    entry, verified = decode_checked(value.whole, *checks)
                else:
                    entry, verified = decode_parts(
                        value.head, value.payload, value.trailer, *checks
                    )
            except EntryError as exc:
                self._refused(digest, str(exc))
                if isinstance(exc, ForeignEntry):  # another key holder's: never deleted
                    return Lookup(None, self.name, f"foreign entry (left for its owner): {exc}")
                if value.whole is not None:  # NOTE: a chunked read may have met a rewrite
                    with contextlib.suppress(StoreUnavailable, KeyRefused):
                        self._call("delete", key)
                return Lookup(None, self.name, f"corrupt entry: {exc}")
        return Lookup(entry, self.name, "hit", verified)

    def put(self, entry: Entry) -> PutResult:
        key = self.config.keys[0] if self.config.keys else None
        data = encode_entry(entry, key=key, namespace=self.config.namespace)
        if len(data) > self.config.remote_max_bytes:
            return PutResult(
                False,
                self.name,
                f"entry of {len(data)} bytes exceeds the remote limit of "
                f"{self.config.remote_max_bytes} bytes (TORCHLOOM_REMOTE_CACHE_MAX_BYTES)",
            )
        self._call("set", self.prefix + entry.digest, data, ex=self.ttl_s)
        return PutResult(True, self.name, "stored")

    def put_raw(self, digest: str, data: bytes) -> None:
        """Store bytes as they are (tests use it to plant corrupt or forged entries)."""
        self._call("set", self.prefix + digest, data, ex=self.ttl_s)

    def delete(self, digest: str) -> bool:
        return bool(self._call("delete", self.prefix + digest))

    def _keys(self) -> list[bytes]:
        keys: list[bytes] = []
        cursor = 0
        digest_only = not self.config.namespace
        while True:
            reply = self._call("scan", cursor, match=self.prefix + "*", count=500)
            try:
                cursor, batch = int(reply[0]), [bytes(k) for k in reply[1]]
            except (TypeError, ValueError, IndexError, KeyError):
                raise StoreUnavailable(
                    f"redis at {redact_url(self.url)}: unexpected SCAN reply "
                    f"({type(reply).__name__}); is this a Redis server?"
                ) from None
            for raw in batch:
                rest = raw[len(self.prefix) :]
                if digest_only and b":" in rest:
                    continue  # another namespace's entry
                keys.append(raw)
            if cursor == 0:
                return keys

    def entries(self) -> Iterator[EntryInfo]:
        for raw_key in self._keys():
            try:
                head = self._getrange(raw_key, 0, _HEADER_READ)
                header, offset = decode_header(head)
                key = CacheKey.from_json(header["key"])
                size = offset + int(header["payload_bytes"])
            except (KeyRefused, EntryError, KeyError, TypeError, ValueError):
                continue
            created = float(header.get("created", 0.0))
            yield EntryInfo(key, size, created, created)

    def clear(self) -> int:
        """Remove every entry of this namespace (never another namespace's)."""
        removed = 0
        for raw_key in self._keys():
            reply = self._call("delete", raw_key)
            removed += reply if isinstance(reply, int) else 0
        return removed

    def count(self) -> int:
        return len(self._keys())
