"""Faults that must never stall or break a compile: a Redis that drips its replies,
unusable and vanishing directories, symlinks planted inside the store, a store
that grows large. Bounds are asserted by what happened (bytes a server got to
send, connections made, scans run), never by wall-clock time."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import threading
from collections.abc import Iterator
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
    _local,
    encode_entry,
)

KEY = b"fleet-key-0123456789abcdef-current"


def _key(i: int) -> CacheKey:
    return CacheKey("prog", (KeyComponent("graph", f"{i:064x}", f"graph {i}"),))


def _entry(i: int, size: int = 100) -> Entry:
    return Entry(_key(i), bytes([i % 256]) * size)


class DripServer:
    """A TCP server that answers every request with a long Redis bulk reply, one
    byte every ``interval`` seconds (each byte arrives well within any per-read
    socket timeout, so only an overall deadline can end the wait)."""

    def __init__(self, interval: float = 0.3, length: int = 200) -> None:
        self.interval = interval
        self.reply = b"$%d\r\n" % length + b"x" * length + b"\r\n"
        self.sent = 0
        self.connections = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.port = self._sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
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
            while not self._stop.is_set():
                try:
                    if not conn.recv(65536):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
                for byte in self.reply:
                    if self._stop.wait(self.interval):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        return  # the client hung up: it stopped waiting
                    self.sent += 1

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def drip() -> Iterator[DripServer]:
    server = DripServer()
    try:
        yield server
    finally:
        server.close()


def test_a_dripping_server_cannot_hold_a_lookup_past_the_deadline(drip: DripServer) -> None:
    remote = RedisStore(drip.url, config=CacheConfig(keys=(KEY,), remote_timeout_s=0.5))
    with pytest.raises(StoreUnavailable, match="deadline") as raised:
        remote.lookup(_key(1).digest)
    sent = drip.sent
    # One byte per 0.3 s against a 0.5 s deadline: a handful of bytes, never the reply.
    assert sent <= 10 < len(drip.reply)
    assert "127.0.0.1" in str(raised.value)


def test_the_circuit_breaker_skips_the_remote_tier_after_a_failure(
    tmp_path: Path, drip: DripServer, caplog: pytest.LogCaptureFixture
) -> None:
    config = CacheConfig(keys=(KEY,), remote_timeout_s=0.5, remote_retry_after_s=3600)
    store = TieredStore(LocalStore(tmp_path, config=config), RedisStore(drip.url, config=config))
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    first = store.lookup(_key(1).digest)
    assert not first.hit and first.reason.endswith("remote unavailable")
    assert store.put(_entry(1)).stored  # the local tier still stores
    assert store.lookup(_key(1).digest).hit
    assert not store.lookup(_key(2).digest).hit
    assert drip.connections == 1  # nothing after the failure went to the server
    assert store.remote_errors == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "remote tier unavailable" in warning and "deadline" in warning
    store._down_until = 0.0  # the breaker's window ends: the next call probes again
    store.lookup(_key(3).digest)
    assert drip.connections == 2 and store.remote_errors == 2


# -- the local store: unusable, vanishing ------------------------------------------------


def test_a_vanishing_layout_directory_is_recreated(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "cache")
    assert store.put(_entry(1)).stored
    shutil.rmtree(tmp_path / "cache" / "v1")
    assert store.lookup(_key(1).digest).reason == "absent"
    assert store.put(_entry(2)).stored and store.lookup(_key(2).digest).hit
    assert store.stats().entries == 1


def test_a_layout_directory_replaced_by_a_file_turns_the_local_tier_off_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path / "cache")
    assert store.put(_entry(1)).stored
    shutil.rmtree(tmp_path / "cache" / "v1")
    (tmp_path / "cache" / "v1").write_text("in the way")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    for i in range(3):
        assert not store.put(_entry(i)).stored
        assert not store.lookup(_key(i).digest).hit
        store.record(hit=False)
        store.record_miss(_key(i))
    assert store.off is not None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "local tier is off" in warning


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_directory_is_not_stored_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # pragma: no cover - CI runs as a user, this machine as root
    (tmp_path / "ro").mkdir(mode=0o500)
    store = LocalStore(tmp_path / "ro" / "cache")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert not store.put(_entry(1)).stored and not store.put(_entry(2)).stored
    assert len(caplog.records) == 1


def test_a_directory_refusing_writes_turns_the_local_tier_off_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What a read-only or foreign directory does to a non-root user, made to happen
    # for root too: creating anything under the root fails with EACCES.
    root = tmp_path / "cache"
    root.mkdir()
    real_mkdir = os.mkdir

    def refusing_mkdir(path: object, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(root)):
            raise PermissionError(13, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    store = LocalStore(root)
    for i in range(3):
        result = store.put(_entry(i))
        assert not result.stored and "Permission denied" in result.reason
        assert not store.lookup(_key(i).digest).hit
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "local tier is off" in warning


# -- symlinks ----------------------------------------------------------------------------


def test_a_symlinked_lock_file_never_creates_or_truncates_its_target(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "cache")
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (tmp_path / "cache" / "v1" / "lock").unlink(missing_ok=True)  # an attacker replaces it
    (tmp_path / "cache" / "v1" / "lock").symlink_to(target)
    missing = tmp_path / "never-created"
    result = store.put(_entry(1))
    assert not result.stored and "lock" in result.reason
    assert target.read_text() == "precious"
    (tmp_path / "cache" / "v1" / "lock").unlink()
    (tmp_path / "cache" / "v1" / "lock").symlink_to(missing)
    store.put(_entry(2))
    store.record(hit=True)
    assert not missing.exists()


def test_a_symlinked_shard_directory_receives_nothing_and_serves_nothing(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "cache")
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = store.path_of(_key(1).digest).parent
    shard.symlink_to(outside, target_is_directory=True)
    result = store.put(_entry(1))
    assert not result.stored and "symlink" in result.reason
    assert list(outside.iterdir()) == []
    # An entry placed behind the link is not served either.
    (outside / store.path_of(_key(1).digest).name).write_bytes(encode_entry(_entry(1)))
    found = store.lookup(_key(1).digest)
    assert not found.hit and "symlink" in found.reason
    assert store.put(_entry(300)).stored  # other shards work


def test_eviction_and_clear_only_remove_the_stores_own_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "cache", max_bytes=10**9)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    victims = []
    for i in range(3):
        victim = foreign / f"{i:064x}.entry"
        victim.write_bytes(encode_entry(_entry(i, 5000)))
        victims.append(victim)
    # A shard directory that is a link to the foreign directory, and an entry
    # file that is a link to a foreign file.
    (store.path_of("ab" + "0" * 62).parent).symlink_to(foreign, target_is_directory=True)
    link = store.path_of(_key(9).digest)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victims[0])
    for i in range(10, 20):
        assert store.put(_entry(i, 1000)).stored
    assert not store.lookup(_key(9).digest).hit  # O_NOFOLLOW: the link is not read
    assert store.evict(0) == 10
    assert store.stats().entries == 0
    store.put(_entry(30))
    assert store.clear() == 1
    assert all(v.exists() for v in victims)
    assert link.is_symlink()


def test_a_symlinked_layout_directory_turns_the_local_tier_off(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "v1").symlink_to(elsewhere, target_is_directory=True)
    store = LocalStore(tmp_path / "cache")
    result = store.put(_entry(1))
    assert not result.stored and "symlink" in result.reason
    assert list(elsewhere.iterdir()) == []


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    store = LocalStore(tmp_path / "link")
    assert store.put(_entry(1)).stored and store.lookup(_key(1).digest).hit


# -- ownership and modes -----------------------------------------------------------------


def test_a_world_writable_directory_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    for _ in range(3):
        LocalStore(root).put(_entry(1))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "writable by every user" in warning


def test_a_group_writable_directory_is_warned_about_unless_shared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("private", "shared"):
        (tmp_path / name).mkdir()
        (tmp_path / name).chmod(0o770)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    LocalStore(tmp_path / "private")
    LocalStore(tmp_path / "shared", config=CacheConfig(mode="shared"))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "writable by its group" in warning and "private" in warning


def test_a_directory_owned_by_someone_else_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_local, "_euid", lambda: os.stat(tmp_path).st_uid + 4242)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    LocalStore(tmp_path / "cache")
    assert any("not by you" in r.getMessage() for r in caplog.records)


def test_files_are_private_by_default_and_group_shared_on_request(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        private = LocalStore(tmp_path / "private")
        private.put(_entry(1))
        path = private.path_of(_key(1).digest)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
        shared = LocalStore(tmp_path / "shared", config=CacheConfig(mode="shared"))
        shared.put(_entry(1))
        path = shared.path_of(_key(1).digest)
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert stat.S_IMODE(path.parent.stat().st_mode) & 0o070 == 0o070
    finally:
        os.umask(old)


# -- scale -------------------------------------------------------------------------------


def test_put_never_scans_the_store_until_the_bound_and_then_evicts_in_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = len(encode_entry(_entry(0, 1000)))
    store = LocalStore(tmp_path, max_bytes=101 * size - 1)
    scans = []
    real = LocalStore._scanned

    def counting(self: LocalStore):  # type: ignore[no-untyped-def]
        scans.append(1)
        return real(self)

    monkeypatch.setattr(LocalStore, "_scanned", counting)
    store.put(_entry(0, 1000))  # the ledger's first use counts the store once
    scans.clear()
    for i in range(1, 100):
        store.put(_entry(i, 1000))
    assert scans == []  # O(1): the ledger, not a scan
    store.put(_entry(100, 1000))  # past the bound: one eviction down to 90%
    assert scans
    scans.clear()
    for i in range(101, 106):
        store.put(_entry(i, 1000))
    assert scans == []  # a batch: the next puts fit again
    stats = store.stats()
    assert stats.entries <= 0.9 * 101 + 5
    assert store.lookup(_key(101).digest).hit and not store.lookup(_key(0).digest).hit


def test_list_and_stats_read_no_entry_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_cache import cache_main

    store = LocalStore(tmp_path)
    for i in range(50):
        store.put(_entry(i))
    reads = []
    real = _local._read_info

    def counting(where: object, name: str):  # type: ignore[no-untyped-def]
        reads.append(name)
        return real(where, name)

    monkeypatch.setattr(_local, "_read_info", counting)
    assert cache_main(["--dir", str(tmp_path), "list"]) == 0
    assert cache_main(["--dir", str(tmp_path), "stats"]) == 0
    out = capsys.readouterr().out
    assert out.count("  prog") == 50 and "entries    50" in out
    assert reads == []  # the index and one directory scan, never the entries
    # An entry the index does not know (written by another version) is still listed.
    (tmp_path / "v1" / "index.tsv").unlink()
    assert cache_main(["--dir", str(tmp_path), "list"]) == 0
    assert capsys.readouterr().out.count("  prog") == 50 and len(reads) == 50
    # Eviction compacts the index to the entries left.
    store.evict(0)
    assert (tmp_path / "v1" / "index.tsv").read_text() == ""
