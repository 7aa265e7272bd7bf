"""The local store: atomic, concurrent, bounded, and loud about damage."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

from loom_cache import CacheKey, Entry, KeyComponent, LocalStore, encode_entry


def _key(i: int, program: str = "prog") -> CacheKey:
    return CacheKey(program, (KeyComponent("graph", f"{i:064x}", f"graph {i}"),))


def _entry(i: int, size: int = 100) -> Entry:
    return Entry(_key(i), bytes([i % 256]) * size)


def test_put_then_lookup_hits_and_absent_key_misses(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(1))
    found = store.lookup(_key(1).digest)
    assert found.hit and found.entry is not None and found.entry.payload == _entry(1).payload
    assert store.lookup(_key(2).digest).reason == "absent"


def _writer(root: str, worker: int, rounds: int) -> None:
    store = LocalStore(root)
    for r in range(rounds):
        # Every worker writes the same key with a payload of its own.
        store.put(Entry(_key(7), bytes([worker]) * (50_000 + r)))
        found = store.lookup(_key(7).digest)
        assert found.entry is not None, found.reason


def test_several_processes_writing_the_same_key_leave_a_whole_entry(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 20)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    found = LocalStore(tmp_path).lookup(_key(7).digest)
    assert found.entry is not None
    assert len(set(found.entry.payload)) == 1  # one writer's payload, never a mix
    assert not list((tmp_path / "v1" / "tmp").iterdir())


def test_truncated_entry_is_a_miss_with_a_reason_and_is_removed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(3, 1000))
    path = store.path_of(_key(3).digest)
    path.write_bytes(path.read_bytes()[:-10])
    found = store.lookup(_key(3).digest)
    assert not found.hit and "truncated" in found.reason
    assert not path.exists()
    assert store.stats().corrupt == 1


def test_corrupted_entry_is_a_miss(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(4, 1000))
    path = store.path_of(_key(4).digest)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    assert "checksum" in store.lookup(_key(4).digest).reason


def test_garbage_and_version_mismatch_are_misses(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    digest = _key(5).digest
    store.path_of(digest).parent.mkdir(parents=True, exist_ok=True)
    store.path_of(digest).write_bytes(b"\x00garbage")
    assert "magic" in store.lookup(digest).reason
    store.path_of(digest).write_bytes(
        encode_entry(_entry(5)).replace(b'"format": 2', b'"format": 1')
    )
    assert "format" in store.lookup(digest).reason


def test_crash_mid_write_leaves_the_store_readable(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(6))
    # A writer killed after writing half its temporary file.
    stale = tmp_path / "v1" / "tmp" / f"{_key(6).digest}.entry.999.dead.tmp"
    stale.write_bytes(encode_entry(_entry(6))[:20])
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.lookup(_key(6).digest).hit
    store.put(_entry(8))  # the next put sweeps stale temporaries
    assert not stale.exists()


def test_lru_eviction_keeps_the_recently_used_entries(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, max_bytes=10**9)
    for i in range(5):
        store.put(_entry(i, 1000))
        os.utime(store.path_of(_key(i).digest), (1000.0 + i, 1000.0 + i))
    assert store.lookup(_key(0).digest).hit  # refreshes entry 0
    keep = sum(store.path_of(_key(i).digest).stat().st_size for i in (0, 3, 4))
    store.evict(keep)
    left = {info.key for info in store.entries()}
    assert left == {_key(0), _key(3), _key(4)}


def test_size_bound_is_enforced_on_put(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, max_bytes=5000)
    for i in range(10):
        store.put(_entry(i, 1000))
    assert store.stats().bytes <= 5000
    assert store.lookup(_key(9).digest).hit


def test_stats_count_hits_and_misses(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.record(hit=False)
    store.record(hit=True)
    store.record(hit=True)
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 1)
    assert stats.hit_rate == pytest.approx(2 / 3)


def test_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "here"))
    assert LocalStore().root == tmp_path / "here"


def _assert_not_stored_with_one_warning(
    store: LocalStore, caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    for i in range(3):
        result = store.put(_entry(i))
        assert not result.stored and reason in result.reason
        found = store.lookup(_key(i).digest)
        assert not found.hit and found.reason.startswith("absent")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert reason in warning


def test_cache_dir_naming_a_regular_file_is_a_miss_and_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = LocalStore(tmp_path / "file")
    _assert_not_stored_with_one_warning(store, caplog, "unusable")
    assert store.stats().entries == 0 and store.misses() == []


def test_uncreatable_parent_is_a_miss_and_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # NOTE: a regular file as an ancestor fails even for root, unlike chmod.
    (tmp_path / "file").write_text("not a directory")
    store = LocalStore(tmp_path / "file" / "deeper" / "cache")
    _assert_not_stored_with_one_warning(store, caplog, "unusable")
    store.record(hit=False)
    store.record_miss(_key(1))


def test_unwritable_entries_directory_is_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    shard = store.path_of(_key(0).digest).parent
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_text("a file where the shard directory goes")
    result = store.put(_entry(0))
    assert not result.stored and "unusable" in result.reason
    assert store.put(_entry(1)).stored  # other shards still work


def test_directory_removed_while_running_is_recreated_by_the_next_put(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "cache")
    assert store.put(_entry(1)).stored
    shutil.rmtree(tmp_path / "cache")
    assert store.lookup(_key(1).digest).reason == "absent"
    store.record(hit=False)
    assert store.put(_entry(2)).stored
    assert store.lookup(_key(2).digest).hit


def test_max_bytes_zero_stores_nothing_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path, max_bytes=0)
    _assert_not_stored_with_one_warning(store, caplog, "size bound is 0")


_KILLED_WRITER = """
import os, signal, sys
from loom_cache import LocalStore
store = LocalStore(sys.argv[1])
tmp = store._write_tmp("ab" * 32 + ".entry", b"x" * (4 << 20))  # a writer's temporary
print(tmp.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # killed before it published the entry
"""


def test_a_killed_writers_temporary_is_swept_by_the_next_put(tmp_path: Path) -> None:
    import subprocess
    import sys

    store = LocalStore(tmp_path)
    store.put(_entry(1))
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], capture_output=True, text=True
    )
    assert child.returncode == -9, child.stderr  # reaped: its pid is gone
    orphan = tmp_path / "v1" / "tmp" / child.stdout.strip()
    assert orphan.stat().st_size == 4 << 20  # fresh: minutes younger than any age limit
    live = store._write_tmp("cd" * 32 + ".entry", b"y")  # this process's, still writing
    store.put(_entry(2))
    assert not orphan.exists()  # its writer's pid is gone from this host
    assert live.exists()  # a live writer's temporary stays


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_live_writers_temporary_is_never_swept_however_old(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    live = store._write_tmp("cd" * 32 + ".entry", b"y")  # one very slow put of a large entry
    _age(live, 3600)
    store.put(_entry(1))
    assert live.exists()  # its writer (this process) is alive: an hour is no proof of death


def test_a_temporary_whose_owner_cannot_be_known_is_swept_by_age(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(_entry(1))
    other_host = tmp_path / "v1" / "tmp" / f"x.entry.elsewhere-{os.getpid()}.{'0' * 32}.tmp"
    other_host.write_bytes(b"z")
    store.put(_entry(2))
    assert other_host.exists()  # another host's writer may be alive
    _age(other_host, 600)
    store.put(_entry(3))
    assert not other_host.exists()  # older than five minutes: taken for dead


def test_a_planted_temporary_with_an_impossible_pid_never_makes_put_raise(tmp_path: Path) -> None:
    from loom_cache._local import _HOST

    store = LocalStore(tmp_path)
    store.put(_entry(1))
    planted = tmp_path / "v1" / "tmp" / f"x.entry.{_HOST}-99999999999999999999.u.tmp"
    planted.write_bytes(b"z")
    for i in (2, 3):
        result = store.put(_entry(i))  # raised OverflowError out of os.kill
        assert result.stored and result.reason == "stored"
    assert store.evict(0) == 3
    assert planted.exists()  # no such pid can be probed: its owner is unknown, it is young
    _age(planted, 600)
    store.put(_entry(4))
    assert not planted.exists()
