"""The remote tier against hostile and broken servers: fake servers on loopback
(small socket servers in this file, every loop bounded by a stop event and
timeouts) and a real redis-server. Nothing a server does escapes as an
exception, holds a lookup past its deadline, grows memory past the read limit,
switches the tier off for one bad key, or shows a password."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loom_cache import (
    CacheConfig,
    CacheKey,
    Entry,
    KeyComponent,
    LocalStore,
    RedisStore,
    StoreUnavailable,
    TieredStore,
    cache_main,
    encode_entry,
    open_default_store,
    redact_url,
)
from loom_cache._config import redact

redis = pytest.importorskip("redis")  # the cache's optional extra; the GPU machine has none
parse_url = redis.connection.parse_url

KEY = b"fleet-key-0123456789abcdef-current"
ATTACKER = b"attacker-key-0123456789abcdef"
HELLO_REPLY = b"%1\r\n+proto\r\n:3\r\n"  # what HELLO 3 needs to see: RESP3, protocol 3
Respond = Callable[[bytes, socket.socket], bool]


def _key(i: int) -> CacheKey:
    return CacheKey("prog", (KeyComponent("graph", f"{i:064x}", f"graph {i}"),))


def _entry(i: int, size: int = 100) -> Entry:
    return Entry(_key(i), bytes([i % 256]) * size)


class FakeServer:
    """A loopback TCP server; ``respond(request, conn)`` answers each request it
    receives and returns False to hang up. Every loop ends on ``close()``."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.1)
            while not self.stop.is_set():
                try:
                    request = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not request:
                    return
                self.requests.append(request)
                try:
                    if not self.respond(request, conn):
                        return
                except OSError:
                    return  # the client hung up

    def close(self) -> None:
        self.stop.set()
        self._sock.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def fake_server() -> Iterator[Callable[[Respond], FakeServer]]:
    servers: list[FakeServer] = []

    def start(respond: Respond) -> FakeServer:
        servers.append(FakeServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _ok_to_everything(request: bytes, conn: socket.socket) -> bool:
    conn.sendall(b"+OK\r\n")
    return True


def _config(**changes: object) -> CacheConfig:
    settings: dict[str, object] = {
        "keys": (KEY,),
        "remote_timeout_s": 1.0,
        "remote_retry_after_s": 3600.0,
    }
    return CacheConfig(**{**settings, **changes})  # type: ignore[arg-type]


# -- 1. any exception is a logged miss that feeds the breaker --------------------------


def test_a_server_answering_ok_to_everything_is_a_logged_miss_and_trips_the_breaker(
    tmp_path: Path,
    fake_server: Callable[[Respond], FakeServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = fake_server(_ok_to_everything)
    config = _config()
    store = TieredStore(LocalStore(tmp_path, config=config), RedisStore(server.url, config=config))
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    found = store.lookup(_key(1).digest)  # redis-py's handshake raises AttributeError here
    assert not found.hit and found.reason.endswith("remote unavailable")
    assert store.remote_errors == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "remote tier unavailable" in warning and "AttributeError" in warning
    store.lookup(_key(2).digest)
    assert server.connections == 1  # the breaker keeps the next lookup off the server
    store._down_until = 0.0
    again = store.lookup(_key(3).digest)
    # The half-set-up connection was dropped: the probe connects afresh and fails the
    # handshake again, rather than reading "+OK" as a value on the old connection.
    assert server.connections == 2 and store.remote_errors == 2
    assert again.reason.endswith("remote unavailable")


def test_cache_clear_against_an_ok_to_everything_server_ends_with_a_message(
    tmp_path: Path,
    fake_server: Callable[[Respond], FakeServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server(_ok_to_everything)
    LocalStore(tmp_path).put(_entry(1))
    status = cache_main(["clear", "--yes"], config=_config(dir=tmp_path, remote_url=server.url))
    out = capsys.readouterr().out
    assert status == 1
    assert "the remote tier failed, so only the local tier is cleared" in out
    assert "removed 1 entries" in out and "Traceback" not in out


def test_a_wrongtype_key_misses_for_that_key_only(
    tmp_path: Path, redis_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    config = _config()
    writer = RedisStore(url, config=config)
    writer.put(_entry(2))
    redis.Redis.from_url(url).lpush(writer.prefix + _key(1).digest, b"a list")
    writer.put_raw(_key(3).digest, b"LOOMCACHE\x00junk")
    store = TieredStore(LocalStore(tmp_path, config=config), RedisStore(url, config=config))
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    wrong = store.lookup(_key(1).digest)
    assert not wrong.hit and "another type of value" in wrong.reason
    corrupt = store.lookup(_key(3).digest)
    assert not corrupt.hit and "corrupt" in corrupt.reason
    assert store.lookup(_key(2).digest).hit  # the tier still serves every valid entry
    assert store.remote_errors == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "refused entry" in warning and "WRONGTYPE" in warning


# -- 2. read limit and one deadline for the whole read ------------------------------------


def _huge_value_server(announced: int) -> Respond:
    block = b"\0" * (1 << 20)

    def respond(request: bytes, conn: socket.socket) -> bool:
        if b"GETRANGE" not in request:
            conn.sendall(HELLO_REPLY if b"HELLO" in request else b"+OK\r\n")
            return True
        conn.sendall(b"$%d\r\n" % announced)
        for _ in range(announced // len(block)):  # bounded: ends when the client hangs up
            conn.sendall(block)
        return False

    return respond


_RSS_CHILD = """
import re, sys, time
from loom_cache import CacheConfig, RedisStore, StoreUnavailable

def peak_rss():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) << 10

store = RedisStore(sys.argv[1], config=CacheConfig(
    keys=(b"fleet-key-0123456789abcdef-current",), remote_timeout_s=float(sys.argv[3]),
    remote_max_bytes=int(sys.argv[4])))
store._client.ping() if sys.argv[5] == "ping" else None
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # Linux: the peak RSS (VmHWM) starts again from the current RSS
before = peak_rss()
start = time.monotonic()
try:
    found = store.lookup(sys.argv[2])
    outcome = f"{found.reason} {len(found.entry.payload) if found.entry else 0}"
except StoreUnavailable as exc:
    outcome = f"unavailable: {exc}"
print(f"{peak_rss() - before} {time.monotonic() - start:.2f} {outcome}")
"""


def _lookup_in_child(
    url: str, digest: str, *, timeout_s: float, limit: int, ping: bool = False
) -> tuple[int, str]:
    """Peak RSS growth (bytes) of one lookup in a fresh process, and its outcome."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure one call's peak RSS")
    out = (
        subprocess.run(
            [
                sys.executable,
                "-c",
                _RSS_CHILD,
                url,
                digest,
                str(timeout_s),
                str(limit),
                "ping" if ping else "-",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    grown, _elapsed, outcome = out.split(" ", 2)
    return int(grown), outcome


def test_a_server_announcing_a_2gb_value_costs_neither_memory_nor_the_deadline(
    fake_server: Callable[[Respond], FakeServer],
) -> None:
    server = fake_server(_huge_value_server(2 << 30))
    grown, outcome = _lookup_in_child(server.url, _key(1).digest, timeout_s=30.0, limit=128 << 20)
    # Ended by the byte budget of the first read (1 MiB asked for), long before a
    # 30 s deadline, and before the 128 MiB read limit: the RSS growth bound.
    assert outcome.startswith("unavailable") and "more than" in outcome, outcome
    assert grown < 64 << 20, f"the lookup grew RSS by {grown >> 20} MiB"


def test_a_real_large_value_costs_under_two_and_a_half_times_its_size(
    redis_server: object,
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    size = 64 << 20
    entry = Entry(_key(5), b"\x17" * size)
    config = _config(remote_max_bytes=256 << 20, remote_timeout_s=60.0)
    assert RedisStore(url, config=config).put(entry).stored
    del entry
    grown, outcome = _lookup_in_child(
        url, _key(5).digest, timeout_s=60.0, limit=256 << 20, ping=True
    )
    assert outcome == f"hit {size}", outcome
    # The value once in the read buffer, the payload once, and a chunk: not 3x.
    assert grown < 2.5 * size, f"the lookup grew RSS by {grown / size:.2f}x the value"


def test_an_entry_past_the_read_limit_is_a_miss_for_that_key_with_a_clear_message(
    tmp_path: Path, redis_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    big = _config(remote_max_bytes=64 << 20)
    RedisStore(url, config=big).put(_entry(6, 5 << 20))
    RedisStore(url, config=big).put(_entry(7))
    small = _config(remote_max_bytes=1 << 20)
    store = TieredStore(LocalStore(tmp_path, config=small), RedisStore(url, config=small))
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    found = store.lookup(_key(6).digest)
    assert not found.hit and "exceeds the remote read limit of 1048576 bytes" in found.reason
    assert "TORCHLOOM_REMOTE_CACHE_MAX_BYTES" in found.reason
    assert store.lookup(_key(7).digest).hit and store.remote_errors == 0
    refused = store.remote.put(_entry(8, 2 << 20))  # type: ignore[union-attr]
    assert not refused.stored and "exceeds the remote limit" in refused.reason


def test_one_deadline_covers_every_chunk_of_a_read(
    fake_server: Callable[[Respond], FakeServer],
) -> None:
    data = encode_entry(_entry(9, 20 << 20), key=KEY)
    chunks: list[bytes] = []

    def respond(request: bytes, conn: socket.socket) -> bool:
        if b"GETRANGE" not in request:
            conn.sendall(HELLO_REPLY if b"HELLO" in request else b"+OK\r\n")
            return True
        parts = request.split(b"\r\n")
        start, end = int(parts[-4]), int(parts[-2])
        chunks.append(request)
        if server.stop.wait(0.4):  # each chunk well within any per-call timeout
            return False
        value = data[start : end + 1]
        conn.sendall(b"$%d\r\n%s\r\n" % (len(value), value))
        return True

    server = fake_server(respond)
    remote = RedisStore(server.url, config=_config(remote_timeout_s=1.0))
    with pytest.raises(StoreUnavailable, match=r"deadline|Timeout"):
        remote.lookup(_key(9).digest)
    # 0.4 s per chunk against one 1 s deadline: at most three chunks were asked for,
    # of the six a 20 MiB entry takes.
    assert 1 <= len(chunks) <= 3


# -- 3. no password in any URL form redis-py accepts ------------------------------------

SECRET = "s3cr3t@pa55"


def _url_forms(port: int) -> list[str]:
    return [
        f"redis://alice:{SECRET.replace('@', '%40')}@127.0.0.1:{port}/0",
        f"redis://alice:{SECRET}@127.0.0.1:{port}/0",  # a raw @ inside the password
        f"redis://:{SECRET}@127.0.0.1:{port}/0",
        f"redis://127.0.0.1:{port}/0?password={SECRET.replace('@', '%40')}",
        f"redis://127.0.0.1:{port}/0?username=alice&password={SECRET}&db=0",
        f"rediss://alice:{SECRET}@127.0.0.1:{port}/0",
        f"unix://alice:{SECRET}@/nonexistent/redis.sock?db=0",
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("form", range(7))
def test_no_url_form_shows_its_password(
    form: int,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = _url_forms(_closed_port())[form]
    parsed = parse_url(url)  # redis-py's own parser says which password it will send
    secrets = {parsed["password"], SECRET, SECRET.replace("@", "%40"), "pa55"}
    assert parsed["password"] == SECRET
    shown = redact_url(url)
    assert "***" in shown and not any(s in shown for s in secrets), shown
    assert not any(s in redact(f"AUTH {parsed['password']} failed", url) for s in secrets)
    caplog.set_level(logging.DEBUG, logger="torchloom.cache")
    # A log line: the remote tier fails (nothing listens there).
    config = _config(remote_url=url, remote_timeout_s=0.5, dir=tmp_path)
    store = TieredStore(LocalStore(config=config), RedisStore(url, config=config))
    assert not store.lookup(_key(1).digest).hit and store.remote_errors == 1
    # A warning: unsigned trust names the server; stats prints it.
    CacheConfig.from_env(
        {"TORCHLOOM_REMOTE_CACHE": url, "TORCHLOOM_REMOTE_CACHE_TRUST": "unsigned"}
    )
    assert cache_main(["stats"], config=config) == 0
    text = caplog.text + capsys.readouterr().out
    assert "remote tier unavailable" in caplog.text and "unsigned" in caplog.text
    assert not any(s in text for s in secrets), text


# -- 8. remote refusals warn once per process, at the default level ---------------------

_REFUSAL_CHILD = """
import sys
from loom_cache import CacheConfig, LocalStore, RedisStore, TieredStore
config = CacheConfig(dir=__import__("pathlib").Path(sys.argv[2]),
                     keys=(b"fleet-key-0123456789abcdef-current",))
store = TieredStore(LocalStore(config=config), RedisStore(sys.argv[1], config=config))
print([store.lookup(d).reason for d in sys.argv[3:]])
"""


def test_forged_remote_entries_warn_once_per_process_with_the_redacted_url(
    tmp_path: Path, redis_with_password: object
) -> None:
    url = redis_with_password.url  # type: ignore[attr-defined]
    password = redis_with_password.password  # type: ignore[attr-defined]
    planter = RedisStore(url, config=CacheConfig(keys=(ATTACKER,)))
    digests = [_key(i).digest for i in (1, 2, 3)]
    for i, digest in zip((1, 2, 3), digests, strict=True):
        planter.put_raw(digest, encode_entry(_entry(i), key=ATTACKER))
    # A fresh interpreter with logging as it comes: WARNING and up reach stderr.
    done = subprocess.run(
        [sys.executable, "-c", _REFUSAL_CHILD, url, str(tmp_path), *digests],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.count("foreign entry") == 3  # signed with a key not held
    lines = [ln for ln in done.stderr.splitlines() if "refused entry" in ln]
    assert len(lines) == 1, done.stderr
    assert redact_url(url) in lines[0] and password not in done.stderr
    assert "signed with key" in lines[0]


def test_the_remote_read_limit_comes_from_the_environment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert (
        CacheConfig.from_env({"TORCHLOOM_REMOTE_CACHE_MAX_BYTES": "8M"}).remote_max_bytes == 8 << 20
    )
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env({"TORCHLOOM_REMOTE_CACHE_MAX_BYTES": "lots"})
    assert config.remote_max_bytes == 128 << 20
    assert "TORCHLOOM_REMOTE_CACHE_MAX_BYTES" in caplog.text


def test_the_stored_header_says_how_large_an_entry_is() -> None:
    # The chunked read sizes its buffer from the header: keep that field in the format.
    data = encode_entry(_entry(1, 1000), key=KEY)
    length = int.from_bytes(data[10:14], "little")
    assert json.loads(data[14 : 14 + length])["payload_bytes"] == 1000


def test_open_default_store_survives_an_unusable_url(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    store = open_default_store(_config(remote_url=f"redis://alice:{SECRET}@host:port/0"))
    assert store.remote is None and SECRET not in caplog.text and "***" in caplog.text
