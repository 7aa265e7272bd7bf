"""The Redis tier against a real redis-server on loopback."""

from __future__ import annotations

import logging
import time
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
    open_default_store,
)


def _entry(i: int) -> Entry:
    return Entry(CacheKey("prog", (KeyComponent("graph", f"{i:064x}", "g"),)), b"x" * 1000)


def test_second_machine_hits_through_redis_and_fills_its_local_tier(
    tmp_path: Path, redis_server: object
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    config = CacheConfig(keys=(b"fleet-key-0123456789abcdef",))
    first = TieredStore(LocalStore(tmp_path / "a", config=config), RedisStore(url, config=config))
    second = TieredStore(LocalStore(tmp_path / "b", config=config), RedisStore(url, config=config))
    first.put(_entry(1))
    found = second.lookup(_entry(1).digest)
    assert found.hit and found.tier == "redis"
    assert second.local.lookup(_entry(1).digest).hit


def test_corrupt_remote_entry_is_a_miss(tmp_path: Path, redis_server: object) -> None:
    remote = RedisStore(redis_server.url)  # type: ignore[attr-defined]
    remote.put_raw(_entry(2).digest, b"LOOMCACHE\x00junk")
    found = TieredStore(LocalStore(tmp_path), remote).lookup(_entry(2).digest)
    assert not found.hit and "corrupt" in found.reason


def test_redis_stopped_mid_run_degrades_to_local_with_one_warning(
    tmp_path: Path, redis_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    store = TieredStore(LocalStore(tmp_path), RedisStore(redis_server.url, timeout_s=0.5))  # type: ignore[attr-defined]
    store.put(_entry(3))
    redis_server.stop()  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    start = time.monotonic()
    store.put(_entry(4))
    assert store.lookup(_entry(4).digest).hit  # local tier still serves
    assert not store.lookup(_entry(5).digest).hit
    store.put(_entry(6))
    elapsed = time.monotonic() - start
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "remote tier unavailable" in warnings[0].getMessage()
    assert store.remote_errors == 1  # later calls skip the dead tier instead of waiting again
    assert elapsed < 30  # bounded: no hang (a generous bound, not a timing benchmark)


def test_unreachable_redis_from_the_start_never_fails_a_lookup(tmp_path: Path) -> None:
    store = TieredStore(LocalStore(tmp_path), RedisStore("redis://127.0.0.1:1/0", timeout_s=0.2))
    assert store.lookup(_entry(7).digest).reason.endswith("remote unavailable")
    store.put(_entry(7))
    assert store.lookup(_entry(7).digest).hit


@pytest.mark.parametrize(
    "url", ["redis://user:s3cr3t-pw@127.0.0.1:1/0", "redis://:s3cr3t-pw@127.0.0.1:1"]
)
def test_the_redis_password_never_reaches_a_log_line_or_error(
    url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", url)
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "0.2")
    monkeypatch.setenv("TORCHLOOM_CACHE_KEY", "fleet-key-0123456789abcdef")
    store = open_default_store()
    store.lookup(_entry(1).digest)
    store.put(_entry(1))
    store.retry_after_s = 0.0
    store._down_until = 0.0
    store.lookup(_entry(2).digest)  # a second failure: the debug line
    remote = store.remote
    assert remote is not None
    with pytest.raises(StoreUnavailable) as raised:
        remote.lookup(_entry(3).digest)
    messages = [r.getMessage() for r in caplog.records] + [str(raised.value)]
    assert any("remote tier unavailable" in m and "***" in m for m in messages)
    assert not [m for m in messages if "s3cr3t" in m]


def test_an_unusable_password_url_is_ignored_without_showing_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", "nosuch://:s3cr3t-pw@host:1/0")
    monkeypatch.setenv("TORCHLOOM_CACHE_KEY", "fleet-key-0123456789abcdef")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert open_default_store().remote is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "ignoring TORCHLOOM_REMOTE_CACHE=nosuch://:***@host:1/0" in warning
    assert "s3cr3t" not in warning


def test_a_full_redis_refuses_writes_and_still_serves_its_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import redis
    from local_redis import RedisServer

    config = CacheConfig(keys=(b"fleet-key-0123456789abcdef",))
    full = ("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    with RedisServer(extra=full) as server:
        assert RedisStore(server.url, config=config).put(_entry(7)).stored
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.OutOfMemoryError):  # fill it until SET is refused
            for i in range(10_000):
                client.set(f"filler:{i}", b"f" * 65536)
        caplog.set_level(logging.WARNING, logger="torchloom.cache")
        store = TieredStore(
            LocalStore(tmp_path, config=config), RedisStore(server.url, config=config)
        )
        big = Entry(_entry(8).key, b"y" * (1 << 20))
        stored = store.put(big)
        assert stored.tier == "local"  # the remote tier refused it: OOM
        (warning,) = [r.getMessage() for r in caplog.records]
        assert "refused SET: OutOfMemoryError" in warning and "still serves" in warning
        found = store.lookup(_entry(7).digest)  # not in the local tier: only Redis has it
        assert found.hit and found.tier == "redis", found.reason
        assert store.local.lookup(_entry(7).digest).hit  # and it was promoted


def test_a_large_remote_hit_and_its_promotion_cost_about_its_size_once(
    tmp_path: Path, redis_server: object
) -> None:
    import tracemalloc

    url = redis_server.url  # type: ignore[attr-defined]
    size = 24 << 20  # several GETRANGE chunks
    config = CacheConfig(keys=(b"fleet-key-0123456789abcdef",), remote_max_bytes=64 << 20)
    digest = _entry(9).digest
    assert RedisStore(url, config=config).put(Entry(_entry(9).key, b"\x17" * size)).stored
    store = TieredStore(LocalStore(tmp_path, config=config), RedisStore(url, config=config))
    tracemalloc.start()
    try:
        found = store.lookup(digest)  # read from Redis, verified, promoted to the local tier
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found.hit and found.tier == "redis" and len(found.entry.payload) == size  # type: ignore[union-attr]
    assert store.local.lookup(digest).hit
    # The payload once, and redis-py's buffers for one 1 MiB GETRANGE reply; it was 3x.
    assert peak < 1.5 * size, f"a remote hit with its promotion peaked at {peak / size:.2f}x"
