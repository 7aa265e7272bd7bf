from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


PythonRunner = Callable[..., str]


@pytest.fixture(autouse=True)
def _fresh_cache_config() -> Iterator[None]:
    """Each test resolves the cache's environment afresh (and sees its warnings)."""
    from loom_cache import _config, _local, _redis

    _config._resolve.cache_clear()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, password: str | None = None) -> None:
        self.port = _free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                *auth,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def _serve_redis(password: str | None) -> Iterator[RedisServer]:
    if not Path(REDIS_SERVER).exists():
        pytest.fail(
            f"redis-server not found at {REDIS_SERVER} (install it: apt-get install redis-server)"
        )
    server = RedisServer(password)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from _serve_redis(None)


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    """A redis-server that requires a password (in its URL: ``redis://:pw@host``)."""
    yield from _serve_redis("pw-s3cr3t-0f-the-fleet")


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
