"""A cache that trusts no writer: forged entries planted in the local directory and
in a real redis-server on loopback are never handed out, so the pickle they carry
never runs; keys rotate; namespaces keep tenants apart; no key, no remote trust."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import pickle
from pathlib import Path

import pytest

from loom_cache import (
    MAGIC,
    CacheConfig,
    CacheKey,
    Entry,
    KeyComponent,
    LocalStore,
    RedisStore,
    TieredStore,
    encode_entry,
    open_default_store,
)
from loom_cache._config import key_id

KEY = b"fleet-key-0123456789abcdef-current"
OLD_KEY = b"fleet-key-0123456789abcdef-previous"
ATTACKER = b"attacker-key-0123456789abcdef"


class _Payload:
    """Unpickling this creates ``marker``: a stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (self.marker,))


def _key(i: int) -> CacheKey:
    return CacheKey("victim.py:forward", (KeyComponent("graph", f"{i:064x}", f"graph {i}"),))


def _evil(i: int, marker: Path) -> Entry:
    return Entry(_key(i), pickle.dumps(_Payload(marker)))


def _resign_header(data: bytes, **changes: object) -> bytes:
    """``data`` with its JSON header edited (the checksum stays valid, the MAC does not)."""
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4
    header = json.loads(data[start : start + length])
    header.update(changes)
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(raw).to_bytes(4, "little") + raw + data[start + length :]


def _forgeries(marker: Path, namespace: str = "") -> list[tuple[str, bytes]]:
    """Every way we know to forge an entry without the fleet key, one digest each."""
    out: list[tuple[str, bytes]] = []

    def add(data: bytes) -> None:
        out.append((_key(len(out)).digest, data))

    add(encode_entry(_evil(0, marker), namespace=namespace))  # unsigned, valid sha256
    add(encode_entry(_evil(1, marker), key=ATTACKER, namespace=namespace))  # another key
    # Claims to be signed with the fleet key; the MAC is made up.
    forged = encode_entry(_evil(2, marker), key=ATTACKER, namespace=namespace)
    add(_resign_header(forged, signed_by=key_id(KEY)))
    # A genuine signed entry whose payload was swapped and checksum recomputed.
    genuine = encode_entry(Entry(_key(3), b"honest artifact"), key=KEY, namespace=namespace)
    evil = pickle.dumps(_Payload(marker))
    body = _resign_header(
        genuine[: -32 - len(b"honest artifact")] + evil,
        payload_bytes=len(evil),
        payload_sha256=hashlib.sha256(evil).hexdigest(),
    )
    add(body + genuine[-32:])
    # The signature stripped off, the header saying "unsigned".
    signed = encode_entry(_evil(4, marker), key=KEY, namespace=namespace)
    add(_resign_header(signed[:-32], signed_by=None))
    # Signed with the attacker's key claiming the id of the previous key.
    add(
        _resign_header(
            encode_entry(_evil(5, marker), key=ATTACKER, namespace=namespace),
            signed_by=key_id(OLD_KEY),
        )
    )
    return out


def _load_all(store: LocalStore | RedisStore | TieredStore, digests: list[str]) -> int:
    """What a reader does: look each digest up and unpickle what it gets."""
    loaded = 0
    for digest in digests:
        found = store.lookup(digest)
        if found.entry is not None:
            pickle.loads(found.entry.payload)
            loaded += 1
    return loaded


def _plant_local(store: LocalStore, forgeries: list[tuple[str, bytes]]) -> None:
    for digest, data in forgeries:
        path = store.path_of(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_no_forged_local_entry_loads_with_a_key_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    store = LocalStore(tmp_path / "cache", config=CacheConfig(keys=(KEY, OLD_KEY)))
    forgeries = _forgeries(marker)
    _plant_local(store, forgeries)
    caplog.set_level(logging.INFO, logger="torchloom.cache")
    assert _load_all(store, [d for d, _ in forgeries]) == 0
    assert not marker.exists()
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == len(forgeries)  # each refusal is logged with its reason
    assert any("unsigned entry refused" in m for m in reasons)
    assert any("signature mismatch" in m for m in reasons)
    (foreign,) = [r for r in caplog.records if "does not hold" in r.getMessage()]
    assert foreign.levelno == logging.INFO  # another key holder's entry, not an attack
    for digest, _ in forgeries[:1] + forgeries[2:]:  # refused entries are removed
        assert not store.path_of(digest).exists()
    assert store.path_of(forgeries[1][0]).exists()  # a foreign one is left for its owner


def test_without_a_key_the_local_tier_trusts_its_own_directory(tmp_path: Path) -> None:
    # The documented single-user trust model: no key, no check beyond integrity.
    marker = tmp_path / "pwned"
    store = LocalStore(tmp_path / "cache", config=CacheConfig())
    store.put(_evil(0, marker))
    assert _load_all(store, [_key(0).digest]) == 1 and marker.exists()


def test_no_forged_remote_entry_loads_or_reaches_the_local_tier(
    tmp_path: Path, redis_server: object
) -> None:
    marker = tmp_path / "pwned"
    config = CacheConfig(keys=(KEY, OLD_KEY), namespace="team-a")
    remote = RedisStore(redis_server.url, config=config)  # type: ignore[attr-defined]
    forgeries = _forgeries(marker, namespace="team-a")
    for digest, data in forgeries:
        remote.put_raw(digest, data)
    local = LocalStore(tmp_path / "cache", config=config)
    store = TieredStore(local, remote)
    assert _load_all(store, [d for d, _ in forgeries]) == 0
    assert not marker.exists()
    assert local.stats().entries == 0  # nothing forged was promoted
    # And with Redis gone, still nothing: the local tier holds no copy to run.
    assert _load_all(LocalStore(tmp_path / "cache", config=config), [d for d, _ in forgeries]) == 0
    assert not marker.exists()


def test_signed_remote_entries_load_and_are_promoted(tmp_path: Path, redis_server: object) -> None:
    config = CacheConfig(keys=(KEY,))
    writer = RedisStore(redis_server.url, config=config)  # type: ignore[attr-defined]
    writer.put(Entry(_key(1), b"artifact"))
    local = LocalStore(tmp_path, config=config)
    found = TieredStore(local, RedisStore(redis_server.url, config=config)).lookup(_key(1).digest)  # type: ignore[attr-defined]
    assert found.hit and found.verified and found.tier == "redis"
    assert local.lookup(_key(1).digest).verified


def test_keys_rotate_current_and_previous(tmp_path: Path) -> None:
    old = LocalStore(tmp_path, config=CacheConfig(keys=(OLD_KEY,)))
    old.put(Entry(_key(1), b"made under the old key"))
    rotated = LocalStore(tmp_path, config=CacheConfig(keys=(KEY, OLD_KEY)))
    assert rotated.lookup(_key(1).digest).verified  # the previous key still reads
    rotated.put(Entry(_key(2), b"made under the new key"))  # written with the current key
    assert LocalStore(tmp_path, config=CacheConfig(keys=(KEY,))).lookup(_key(2).digest).hit
    retired = LocalStore(tmp_path, config=CacheConfig(keys=(KEY,)))
    assert "does not hold" in retired.lookup(_key(1).digest).reason  # old key retired


def test_tenants_sharing_one_redis_never_see_each_other(redis_server: object) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    a = RedisStore(url, config=CacheConfig(keys=(KEY,), namespace="team-a"))
    b = RedisStore(url, config=CacheConfig(keys=(KEY,), namespace="team-b"))
    plain = RedisStore(url, config=CacheConfig(keys=(KEY,)))
    a.put(Entry(_key(1), b"team a's artifact"))
    assert b.lookup(_key(1).digest).reason == "absent"
    assert plain.lookup(_key(1).digest).reason == "absent"
    # Copying a's bytes under b's name is refused: the namespace is signed in.
    raw = a._client.get(a.prefix + _key(1).digest)
    b.put_raw(_key(1).digest, raw)
    assert "namespace" in b.lookup(_key(1).digest).reason
    b.put(Entry(_key(2), b"b"))
    assert b.clear() == 1 and plain.clear() == 0
    assert a.lookup(_key(1).digest).hit  # clearing b never touches a


def test_no_key_and_a_remote_tier_warns_and_turns_the_remote_tier_off(
    tmp_path: Path,
    redis_server: object,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    marker = tmp_path / "pwned"
    url = redis_server.url  # type: ignore[attr-defined]
    RedisStore(url, config=CacheConfig(remote_trust="unsigned")).put(_evil(1, marker))
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", url)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    store = open_default_store()
    assert store.remote is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no cache key is set" in warning and "TORCHLOOM_CACHE_KEY" in warning
    assert "TORCHLOOM_REMOTE_CACHE_TRUST=unsigned" in warning
    assert _load_all(store, [_key(1).digest]) == 0 and not marker.exists()


def test_unsigned_trust_is_an_explicit_opt_in_warned_once(
    tmp_path: Path,
    redis_server: object,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    RedisStore(url, config=CacheConfig(remote_trust="unsigned")).put(Entry(_key(1), b"x"))
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", url)
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TRUST", "unsigned")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    for _ in range(3):
        store = open_default_store()
    assert store.lookup(_key(1).digest).hit
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "serves unsigned entries" in warnings[0]


def test_an_unsigned_remote_entry_is_never_signed_into_the_local_tier(
    tmp_path: Path, redis_server: object
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    RedisStore(url, config=CacheConfig(remote_trust="unsigned")).put(Entry(_key(1), b"x"))
    config = CacheConfig(keys=(KEY,), remote_trust="unsigned")
    local = LocalStore(tmp_path, config=config)
    found = TieredStore(local, RedisStore(url, config=config)).lookup(_key(1).digest)
    assert found.hit and not found.verified
    assert local.lookup(_key(1).digest).reason == "absent"


def test_key_file_current_then_previous_and_no_secret_in_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n" + OLD_KEY + b"\n")
    monkeypatch.setenv("TORCHLOOM_CACHE_KEY_FILE", str(key_file))
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", "redis://:pw-secret@127.0.0.1:1/0")
    config = CacheConfig.from_env()
    assert config.keys == (KEY, OLD_KEY)
    for text in (repr(config), config.describe()):
        assert KEY.decode() not in text and "pw-secret" not in text


@pytest.mark.parametrize("where", ["TORCHLOOM_CACHE_KEY", "TORCHLOOM_CACHE_KEY_FILE"])
def test_a_key_shorter_than_16_bytes_fails_closed_like_a_missing_key_file(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    planted = LocalStore(tmp_path / "cache", config=CacheConfig(tmp_path / "cache"))
    planted.put(_evil(1, marker))  # unsigned, planted in the private directory
    key_file = tmp_path / "key"
    key_file.write_text("only15bytes-key\n")
    key_file.chmod(0o600)
    value = "only15bytes-key" if where == "TORCHLOOM_CACHE_KEY" else str(key_file)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env({where: value, "TORCHLOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert config.key_missing is not None and f"{where}" in config.key_missing
    assert "15 bytes" in config.key_missing and "at least 16" in config.key_missing
    store = LocalStore(config=config)
    found = store.lookup(_key(1).digest)
    assert not found.hit and "fail closed" in found.reason
    assert _load_all(store, [_key(1).digest]) == 0 and not marker.exists()
    assert not store.put(Entry(_key(2), b"would be unsigned")).stored
    assert planted.path_of(_key(1).digest).exists()  # refused, not destroyed
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and "refuses every entry" in record.getMessage()
    assert "only15bytes" not in caplog.text and key_id(b"only15bytes-key") not in caplog.text


def test_a_short_key_beside_a_usable_one_warns_and_the_usable_one_signs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env(
        {"TORCHLOOM_CACHE_KEY": "short", "TORCHLOOM_CACHE_PREVIOUS_KEY": OLD_KEY.decode()}
    )
    assert config.keys == (OLD_KEY,) and config.key_missing is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "at least 16" in warning and "short" not in warning


def test_config_refuses_bad_values_given_in_code(tmp_path: Path) -> None:
    from loom_cache import CacheConfigError

    with pytest.raises(CacheConfigError, match="namespace"):
        CacheConfig(namespace="a b")
    with pytest.raises(CacheConfigError, match="16 bytes"):
        CacheConfig(keys=(b"short",))
    assert dataclasses.replace(CacheConfig(), namespace="ok-1").namespace == "ok-1"


def test_a_key_that_is_not_utf8_is_taken_as_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = b"\xff\xfe-not-utf8-key-0123456789"  # what "$(head -c 32 /dev/urandom)" gives
    monkeypatch.setitem(os.environb, b"TORCHLOOM_CACHE_KEY", raw)
    monkeypatch.setitem(os.environb, b"TORCHLOOM_CACHE_PREVIOUS_KEY", raw[::-1])
    config = CacheConfig.from_env()  # raised UnicodeEncodeError, failing every compile
    assert config.keys == (raw, raw[::-1]) and config.key_missing is None
    store = LocalStore(tmp_path, config=config)
    assert store.put(Entry(_key(1), b"artifact")).stored
    assert store.lookup(_key(1).digest).verified


def test_two_keys_on_one_directory_skip_each_others_entries_and_delete_none(
    tmp_path: Path,
) -> None:
    fleet_a = LocalStore(tmp_path, config=CacheConfig(keys=(KEY,)))
    fleet_b = LocalStore(tmp_path, config=CacheConfig(keys=(ATTACKER,)))
    assert fleet_a.put(Entry(_key(1), b"a's artifact")).stored
    assert fleet_b.put(Entry(_key(2), b"b's artifact")).stored
    for reader, other in ((fleet_a, _key(2)), (fleet_b, _key(1))):
        found = reader.lookup(other.digest)
        assert not found.hit and found.reason.startswith("foreign entry")
        assert "does not hold" in found.reason
        assert reader.path_of(other.digest).exists()  # deleted as "corrupt" before
    assert fleet_a.lookup(_key(1).digest).verified and fleet_b.lookup(_key(2).digest).verified
    assert fleet_a.stats().corrupt == 0 and fleet_b.stats().corrupt == 0


def test_a_foreign_remote_entry_is_skipped_not_deleted(redis_server: object) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    RedisStore(url, config=CacheConfig(keys=(KEY,))).put(Entry(_key(1), b"a's artifact"))
    found = RedisStore(url, config=CacheConfig(keys=(ATTACKER,))).lookup(_key(1).digest)
    assert not found.hit and "does not hold" in found.reason
    assert RedisStore(url, config=CacheConfig(keys=(KEY,))).lookup(_key(1).digest).verified


def test_a_rotated_key_file_is_read_again_within_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom_cache import _config

    clock = [1000.0]
    monkeypatch.setattr(_config, "_monotonic", lambda: clock[0])
    key_file = tmp_path / "key"
    key_file.write_bytes(OLD_KEY + b"\n")
    key_file.chmod(0o600)
    env = {"TORCHLOOM_CACHE_KEY_FILE": str(key_file), "TORCHLOOM_CACHE_DIR": str(tmp_path / "c")}
    started = CacheConfig.from_env(env)  # a process started before the rotation
    assert started.keys == (OLD_KEY,)
    key_file.write_bytes(KEY + b"\n" + OLD_KEY + b"\n")  # the rotation, as docs/cache.md says
    os.utime(key_file, ns=(key_file.stat().st_mtime_ns + 10**9,) * 2)
    clock[0] += 30
    assert CacheConfig.from_env(env).keys == (OLD_KEY,)  # at most one stat a minute
    clock[0] += 31
    rotated = CacheConfig.from_env(env)
    assert rotated.keys == (KEY, OLD_KEY)
    new_writer = LocalStore(config=rotated)
    new_writer.put(Entry(_key(1), b"signed with the new key"))
    assert LocalStore(config=rotated).lookup(_key(1).digest).verified
    clock[0] += 61
    assert CacheConfig.from_env(env) is rotated  # unchanged file: the same configuration
