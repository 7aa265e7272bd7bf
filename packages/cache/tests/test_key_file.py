"""``TORCHLOOM_CACHE_KEY_FILE`` is read the way a careful daemon reads a secret: a
regular file (or a symlink to one) of at most 4 KiB, opened without blocking.
Anything else (a FIFO, a device, a directory, an oversized file) is one warning
that names the variable and what it found, and the cache fails closed: no
remote tier, no entry served or stored. Never a hang, never unbounded memory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom_cache import CacheConfig
from loom_cache._config import KEY_FILE_MAX_BYTES
from loom_cache._tiered import open_store

KEY = "k" * 32
#: A hang detector, not a timing assertion: before the fix these never returned.
HANG_S = 30


def _config_in_child(tmp_path: Path, key_file: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import logging, loom_cache\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "c = loom_cache.CacheConfig.from_env()\n"
        "print('key_missing:', c.key_missing)\n"
        "print('remote:', loom_cache.open_default_store(c).remote)\n"
    )
    env = {
        **os.environ,
        "TORCHLOOM_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHLOOM_CACHE_KEY_FILE": key_file,
        "TORCHLOOM_REMOTE_CACHE": "redis://127.0.0.1:1/0",
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
        check=True,
    )


@pytest.mark.parametrize(
    ("target", "found"),
    [
        ("fifo", "a FIFO"),
        ("/dev/zero", "a character device"),
        ("/dev/urandom", "a character device"),
        ("dir", "a directory"),
    ],
)
def test_a_key_file_that_is_not_a_regular_file_returns_warns_and_fails_closed(
    tmp_path: Path, target: str, found: str
) -> None:
    if target == "fifo":
        os.mkfifo(tmp_path / "k.fifo")  # no writer: a plain open() or read() blocks forever
        path = tmp_path / "k.fifo"
    elif target == "dir":
        path = tmp_path / "keys"
        path.mkdir()
    else:
        path = tmp_path / "k.link"  # a symlink to a device, as /dev/fd paths are
        path.symlink_to(target)
    out = _config_in_child(tmp_path, str(path))
    assert f"key_missing: TORCHLOOM_CACHE_KEY_FILE={str(path)!r} cannot be read: it is {found}" in (
        out.stdout
    )
    assert "remote: None" in out.stdout  # the remote tier fails closed
    warnings = [ln for ln in out.stderr.splitlines() if "TORCHLOOM_CACHE_KEY_FILE" in ln]
    assert len(warnings) == 1 and found in warnings[0], out.stderr


def test_a_key_file_past_the_cap_is_refused_without_reading_it_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"k" * (KEY_FILE_MAX_BYTES + 1))
    path.chmod(0o600)
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    config = CacheConfig.from_env({"TORCHLOOM_CACHE_KEY_FILE": str(path)})
    assert config.keys == () and config.key_missing is not None
    assert f"more than the {KEY_FILE_MAX_BYTES} bytes" in config.key_missing
    (record,) = [r for r in caplog.records if "TORCHLOOM_CACHE_KEY_FILE" in r.getMessage()]
    assert str(path) in record.getMessage()


def test_a_symlink_to_a_regular_key_file_is_read(tmp_path: Path) -> None:
    real = tmp_path / "real-key"
    real.write_text(KEY + "\n")
    real.chmod(0o600)
    link = tmp_path / "key-link"
    link.symlink_to(real)
    config = CacheConfig.from_env(
        {"TORCHLOOM_CACHE_KEY_FILE": str(link), "TORCHLOOM_CACHE_DIR": str(tmp_path / "c")}
    )
    assert config.keys == (KEY.encode(),) and config.key_missing is None
    assert open_store(config, create=False).local.config.signing
