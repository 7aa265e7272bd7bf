from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from local_redis import RedisServer

PythonRunner = Callable[..., str]


@pytest.fixture(autouse=True)
def _fresh_cache_config() -> Iterator[None]:
    """Each test resolves the cache's environment afresh (and sees its warnings)."""
    from loom_cache import _config, _local, _redis

    _config._resolve.cache_clear()
    _config._stamps.clear()
    _local._warned_roots.clear()
    _redis._warned_refusals.clear()
    yield
    _config._resolve.cache_clear()


def _run_python(code: str, *, hashseed: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter and return its stripped stdout."""
    full_env = {**os.environ, "PYTHONHASHSEED": hashseed, **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=full_env
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real Redis server on loopback (scripts/local_redis.py finds its binary)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    """A Redis server that requires a password (in its URL: ``redis://:pw@host``)."""
    with RedisServer("pw-s3cr3t-0f-the-fleet") as server:
        yield server


@pytest.fixture
def run_python() -> PythonRunner:
    """Run code in a fresh interpreter (given PYTHONHASHSEED); its last stdout line."""
    return _run_python


def _run_python_pair(code: str, seeds: tuple[str, str]) -> tuple[str, str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in seeds
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out.strip().splitlines()[-1])
    return outs[0], outs[1]


@pytest.fixture
def run_python_pair() -> Callable[..., tuple[str, str]]:
    """Run code in two fresh interpreters at once with the given hash seeds."""
    return _run_python_pair
