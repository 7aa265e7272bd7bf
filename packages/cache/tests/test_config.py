"""The cache's environment variables: validated, never silent, never a crash;
URLs in messages never carry a password."""

from __future__ import annotations

import logging

import pytest

from loom_cache import (
    CacheConfig,
    CacheConfigError,
    CacheKey,
    Entry,
    KeyComponent,
    LocalStore,
    RedisStore,
    parse_size,
    redact_url,
)
from loom_cache._config import (
    DEFAULT_MAX_BYTES,
    DEFAULT_RETRY_AFTER_S,
    DEFAULT_TIMEOUT_S,
    redact,
    timeout_from_env,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1K", 1 << 10),
        ("512M", 512 << 20),
        ("1G", 1 << 30),
        ("2T", 2 << 40),
        ("1g", 1 << 30),
        ("3GiB", 3 << 30),
        ("64kib", 64 << 10),
        ("10MB", 10 << 20),
        (" 7 G ", 7 << 30),
    ],
)
def test_sizes_accept_integers_and_binary_suffixes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1e9", "-5", "1.5G", "abc", "", "G", "5X"])
def test_sizes_refuse_exponents_fractions_negatives_and_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("raw", ["-5", "1e9", "lots"])
def test_bad_max_bytes_warns_naming_the_variable_and_uses_the_default(
    raw: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHLOOM_CACHE_MAX_BYTES", raw)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert LocalStore(str(tmp_path)).max_bytes == DEFAULT_MAX_BYTES
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "TORCHLOOM_CACHE_MAX_BYTES" in warning and repr(raw) in warning


def test_max_bytes_with_a_suffix_is_used(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHLOOM_CACHE_MAX_BYTES", "1G")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert LocalStore(str(tmp_path)).max_bytes == 1 << 30
    assert not caplog.records


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf"])
def test_bad_remote_timeout_warns_naming_the_variable_and_uses_the_default(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TIMEOUT", raw)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    assert timeout_from_env() == DEFAULT_TIMEOUT_S
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "TORCHLOOM_REMOTE_CACHE_TIMEOUT" in warning and repr(raw) in warning


def test_good_remote_timeout_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "2.5")
    assert timeout_from_env() == 2.5


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:secret@host", "redis://:***@host"),
        ("rediss://u:p%40ss@h:1/2", "rediss://u:***@h:1/2"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://user@host/0", "redis://user@host/0"),
    ],
)
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_messages_lose_the_password_as_written_and_decoded() -> None:
    url = "redis://u:p%40ss@h:1/2"
    assert redact("auth failed for p@ss and p%40ss", url) == "auth failed for *** and ***"


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "1e10"),  # every remote call overflowed time_t
        ("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "99999999999"),
        ("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "601"),
        ("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "\uff11\uff12"),  # fullwidth "12"
        ("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "\u0663"),  # Arabic-Indic "3"
        ("TORCHLOOM_REMOTE_CACHE_RETRY_AFTER", "1e300"),
        ("TORCHLOOM_REMOTE_CACHE_RETRY_AFTER", "\u0663"),
    ],
)
def test_an_absurd_or_non_ascii_number_of_seconds_warns_naming_the_variable_and_uses_the_default(
    var: str, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env({var: raw})
    assert (config.remote_timeout_s, config.remote_retry_after_s) == (
        DEFAULT_TIMEOUT_S,
        DEFAULT_RETRY_AFTER_S,
    )
    (warning,) = [r.getMessage() for r in caplog.records]
    assert var in warning and repr(raw) in warning and "ASCII digits" in warning


@pytest.mark.parametrize("text", ["\uff11\uff12\uff13", "\u0663", "1\u0663K", "99999999999T"])
def test_sizes_refuse_non_ascii_digits_and_sizes_past_one_pib(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size|past the largest size"):
        parse_size(text)


@pytest.mark.parametrize(
    "changes",
    [
        {"remote_timeout_s": 1e10},
        {"remote_retry_after_s": 1e300},
        {"max_bytes": 1 << 60},
        {"remote_max_bytes": 1 << 60},
    ],
)
def test_absurd_numbers_given_in_code_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(CacheConfigError, match="must be"):
        CacheConfig(**changes)  # type: ignore[arg-type]


def test_an_absurd_timeout_from_the_environment_leaves_the_remote_tier_working(
    tmp_path: object, redis_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "1e10")
    monkeypatch.setenv("TORCHLOOM_CACHE_KEY", "fleet-key-0123456789abcdef")
    store = RedisStore(redis_server.url)  # type: ignore[attr-defined]
    assert store.timeout_s == DEFAULT_TIMEOUT_S
    entry = Entry(CacheKey("p", (KeyComponent("graph", "ab" * 32, "g"),)), b"payload")
    assert store.put(entry).stored  # no OverflowError from the socket's timeout
    assert store.lookup(entry.digest).hit


@pytest.mark.parametrize(
    "var",
    [
        "TORCHLOOM_REMOTE_CACHE",
        "TORCHLOOM_CACHE_KEY_FILE",
        "TORCHLOOM_CACHE_DIR",
        "TORCHLOOM_CACHE_MODE",
        "TORCHLOOM_REMOTE_CACHE_TIMEOUT",
    ],
)
@pytest.mark.parametrize("control", ["\n", "\r", "\x1b[2K", "\u2028"])
def test_a_control_character_in_a_setting_is_refused_and_never_forges_a_log_line(
    var: str, control: str, caplog: pytest.LogCaptureFixture
) -> None:
    forged = f"{control}WARNING:torchloom.cache:loom cache: all clear"
    value = {
        "TORCHLOOM_REMOTE_CACHE": "redis://:pw-s3cret@127.0.0.1:1/0",
        "TORCHLOOM_CACHE_KEY_FILE": "/run/secrets/loom-key",
        "TORCHLOOM_CACHE_DIR": "/tmp/loom-cache",
        "TORCHLOOM_CACHE_MODE": "shared",
        "TORCHLOOM_REMOTE_CACHE_TIMEOUT": "2",
    }[var]
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    key = {} if var == "TORCHLOOM_CACHE_KEY_FILE" else {"TORCHLOOM_CACHE_KEY": "k" * 32}
    config = CacheConfig.from_env({var: value + forged, **key})
    messages = [r.getMessage() for r in caplog.records]
    assert any(var in m and "control character" in m for m in messages), messages
    assert not any(c in m for m in messages for c in "\n\r\x1b\u2028")
    assert "pw-s3cret" not in caplog.text
    assert not any(c in repr(config) + config.describe() for c in "\n\r\x1b\u2028")
    if var == "TORCHLOOM_CACHE_KEY_FILE":
        assert config.key_missing is not None and config.keys == ()  # fails closed
