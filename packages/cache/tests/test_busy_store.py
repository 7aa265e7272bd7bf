"""The local tier on a busy fleet: another process holding the store's lock, a
disk that fills, key files that are missing or too open, namespaces sharing one
directory. Reads never wait on the lock, a put tells the truth about what it
published, and every problem is worded as what it is."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import filelock
import pytest

from loom_cache import (
    CacheConfig,
    CacheKey,
    Entry,
    KeyComponent,
    LocalStore,
    _local,
    cache_main,
)

KEY = b"fleet-key-0123456789abcdef-current"


def _key(i: int) -> CacheKey:
    return CacheKey("prog", (KeyComponent("graph", f"{i:064x}", f"graph {i}"),))


def _entry(i: int, size: int = 100) -> Entry:
    return Entry(_key(i), bytes([i % 256]) * size)


_HOLDER = """
import sys, filelock
locks = [filelock.FileLock(p, timeout=30) for p in sys.argv[1:]]
for lock in locks:
    lock.acquire()
print("held", flush=True)
sys.stdin.read()  # holds until the test closes stdin (or is killed)
"""


@pytest.fixture
def lock_holder() -> Iterator[object]:
    """``hold(*paths)``: another process takes these lock files and keeps them until
    the test ends."""
    procs: list[subprocess.Popen[str]] = []

    def hold(*paths: Path) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"

    yield hold
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def _hit(store: LocalStore, digest: str) -> float:
    start = time.monotonic()
    found = store.lookup(digest)
    store.record(hit=found.hit)
    assert found.hit
    return time.monotonic() - start


def test_a_hit_while_another_process_holds_the_lock_does_not_wait_for_it(
    tmp_path: Path, lock_holder: object
) -> None:
    store = LocalStore(tmp_path)
    assert store.put(_entry(1)).stored
    unlocked = min(_hit(store, _key(1).digest) for _ in range(5))
    lock_holder(tmp_path / "v1" / "lock", tmp_path / "v1" / "evict.lock")  # type: ignore[operator]
    held = max(_hit(store, _key(1).digest) for _ in range(5))
    # The lock times out after 10 s: a hit that waited on it would take that long.
    assert held < unlocked + 1.0, (held, unlocked)
    # A miss while it is held: counted, recorded and stored, in well under 10 s.
    start = time.monotonic()
    missed = store.lookup(_key(2).digest)
    store.record(hit=False)
    store.record_miss(_key(2))
    stored = store.put(_entry(2))
    assert not missed.hit and stored.stored and stored.reason == "stored"
    assert time.monotonic() - start < 5.0
    assert store.lookup(_key(2).digest).hit
    stats = store.stats()  # the journals not yet folded count too
    assert (stats.hits, stats.misses, stats.entries) == (10, 1, 2)
    assert store.off is None


def test_counts_survive_the_fold_and_no_append_is_counted_twice(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(1))
    for _ in range(7):
        store.record(hit=True)
    store.record(hit=False)
    store.put(_entry(2))  # folds the journals into stats.json
    assert not (tmp_path / "v1" / "hits.count").exists()
    store.record(hit=True)
    stats = store.stats()
    assert (stats.hits, stats.misses) == (8, 1)
    assert LocalStore(tmp_path)._read_json(tmp_path / "v1" / "ledger.json")["bytes"] == sum(
        p.stat().st_size for p in (tmp_path / "v1" / "entries").rglob("*.entry")
    )


def test_eviction_never_unlinks_under_the_store_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path, max_bytes=10**9)
    for i in range(40):
        assert store.put(_entry(i, 1000)).stored
    store.max_bytes = store.stats().bytes  # full: the next put passes the bound
    free_during_unlink: list[bool] = []
    real_unlink = _local._unlink
    probe = filelock.FileLock(str(tmp_path / "v1" / "lock"))

    def probing_unlink(where: object, name: str) -> None:
        try:
            probe.acquire(timeout=0)  # another descriptor: fails while anyone holds it
        except filelock.Timeout:
            free_during_unlink.append(False)
        else:
            probe.release()
            free_during_unlink.append(True)
        real_unlink(where, name)

    monkeypatch.setattr(_local, "_unlink", probing_unlink)
    assert store.put(_entry(99, 1000)).stored  # past the bound: one eviction batch
    assert free_during_unlink and all(free_during_unlink)
    assert len(free_during_unlink) >= 4 and store.stats().entries <= 0.9 * 41
    assert store.lookup(_key(99).digest).hit


def test_a_busy_lock_is_reported_as_busy_not_unusable(
    tmp_path: Path,
    lock_holder: object,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(1))
    monkeypatch.setattr(_local, "_LOCK_TIMEOUT_S", 0.5)
    store._evict_lock = filelock.FileLock(str(tmp_path / "v1" / "evict.lock"), timeout=0.5)
    lock_holder(tmp_path / "v1" / "evict.lock")  # type: ignore[operator]
    caplog.set_level(logging.INFO, logger="torchloom.cache")
    assert store.evict(0) == 0
    assert store.clear() == 0
    text = caplog.text
    assert "busy" in text and "unusable" not in text
    assert store.off is None and store.lookup(_key(1).digest).hit


def test_disk_full_at_the_ledger_says_stored_and_the_ledger_is_rebuilt_on_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(1))

    def full(self: LocalStore, path: Path, value: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(LocalStore, "_write_json", full)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    result = store.put(_entry(2, 5000))
    assert result.stored and "disk full" in result.reason  # it was published
    assert store.lookup(_key(2).digest).hit and store.off is None
    assert "disk full" in caplog.text and "unusable" not in caplog.text
    assert not (tmp_path / "v1" / "ledger.json").exists()  # dropped: it may be wrong
    monkeypatch.undo()
    LocalStore(tmp_path)  # the next open counts the store once
    on_disk = sum(p.stat().st_size for p in (tmp_path / "v1" / "entries").rglob("*.entry"))
    assert store._read_json(tmp_path / "v1" / "ledger.json") == {"bytes": on_disk}


def test_disk_full_at_the_entry_is_not_stored_and_worded_as_disk_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    real = LocalStore._write_tmp

    def full(self: LocalStore, name: str, *parts: bytes) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStore, "_write_tmp", full)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    result = store.put(_entry(1))
    assert not result.stored and result.reason.startswith("disk full")
    assert "unusable" not in result.reason and "unusable" not in caplog.text
    monkeypatch.setattr(LocalStore, "_write_tmp", real)
    assert store.off is None and store.put(_entry(1)).stored  # space again: stored


_PAST_THE_FILE_SIZE_LIMIT = """
import logging, resource, sys
from loom_cache import CacheKey, Entry, KeyComponent, LocalStore
logging.basicConfig(level=logging.WARNING)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
store = LocalStore(sys.argv[1])
key = CacheKey("prog", (KeyComponent("graph", "0" * 64, "g"),))
result = store.put(Entry(key, b"x" * (1 << 20)))  # past ulimit -f: EFBIG (SIGXFSZ is ignored)
print(result.stored, store.off, result.reason, sep="|")
"""


def test_a_file_size_limit_is_worded_as_the_limit_it_is_not_unusable(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _PAST_THE_FILE_SIZE_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    stored, off, reason = child.stdout.strip().split("|")
    assert (stored, off) == ("False", "None")
    assert reason.startswith("file size limit") and "unusable" not in reason
    assert "unusable" not in child.stderr and "file size limit" in child.stderr


# -- key files ---------------------------------------------------------------------------


def _from_key_file(path: Path) -> CacheConfig:
    return CacheConfig.from_env({"TORCHLOOM_CACHE_KEY_FILE": str(path)})


def test_a_comment_only_key_file_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    path.write_text("# the fleet key goes here\n\n#\n")
    path.chmod(0o600)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert _from_key_file(path).keys == ()
    assert "holds no key (only comments)" in caplog.text


@pytest.mark.parametrize(("mode", "word"), [(0o604, "read"), (0o602, "written")])
def test_a_key_file_every_user_can_read_or_write_warns(
    tmp_path: Path, mode: int, word: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_text(KEY.decode() + "\n")
    path.chmod(mode)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert _from_key_file(path).keys == (KEY,)  # used, with a warning
    assert f"can be {word} by every user" in caplog.text and KEY.decode() not in caplog.text


def test_a_missing_key_file_fails_closed_with_one_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    planted = LocalStore(tmp_path / "cache", config=CacheConfig(dir=tmp_path / "cache"))
    planted.put(_entry(1))  # an unsigned entry, say one an attacker planted
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env(
        {
            "TORCHLOOM_CACHE_KEY_FILE": str(tmp_path / "gone"),
            "TORCHLOOM_CACHE_DIR": str(tmp_path / "cache"),
            "TORCHLOOM_REMOTE_CACHE": "redis://127.0.0.1:1/0",
        }
    )
    assert config.key_missing is not None and config.refuses_unsigned
    store = LocalStore(config=config)
    found = store.lookup(_key(1).digest)
    assert not found.hit and "fail closed" in found.reason
    assert not store.put(_entry(2)).stored
    assert planted.path_of(_key(1).digest).exists()  # refused, not destroyed
    (record,) = caplog.records  # one message: no second "remote tier off" warning
    assert record.levelno == logging.ERROR and "refuses every entry" in record.getMessage()
    from loom_cache import open_default_store

    assert open_default_store(config).remote is None


# -- namespaces --------------------------------------------------------------------------


def test_namespaces_sharing_a_directory_never_serve_each_others_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = LocalStore(config=CacheConfig(dir=tmp_path, namespace="team-a"))
    b = LocalStore(config=CacheConfig(dir=tmp_path, namespace="team-b"))
    plain = LocalStore(tmp_path)
    assert a.put(_entry(1)).stored
    assert not b.lookup(_key(1).digest).hit and not plain.lookup(_key(1).digest).hit
    b.put(Entry(_key(1), b"b's artifact"))
    assert a.lookup(_key(1).digest).entry.payload == _entry(1).payload  # type: ignore[union-attr]
    assert b.lookup(_key(1).digest).entry.payload == b"b's artifact"  # type: ignore[union-attr]
    assert (a.stats().entries, b.stats().entries, plain.stats().entries) == (1, 1, 0)
    b.clear()
    assert a.lookup(_key(1).digest).hit  # clear is per namespace too
    assert cache_main(["stats"], config=CacheConfig(dir=tmp_path, namespace="team-a")) == 0
    assert f"namespace  team-a (local entries under {tmp_path / 'ns-team-a'})" in (
        capsys.readouterr().out
    )


def test_a_namespace_never_leaves_the_cache_directory(tmp_path: Path) -> None:
    store = LocalStore(config=CacheConfig(dir=tmp_path / "cache", namespace=".."))
    assert store.put(_entry(1)).stored
    assert store.path_of(_key(1).digest).is_relative_to(tmp_path / "cache" / "ns-..")
    assert sorted(os.listdir(tmp_path)) == ["cache"]


# -- the command line ----------------------------------------------------------------------


def test_read_only_commands_create_no_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new"
    for command in (["stats"], ["list"], ["explain"], ["clear", "--yes"]):
        cache_main(["--dir", str(new), *command])
    assert "entries    0" in capsys.readouterr().out
    assert not new.exists()
