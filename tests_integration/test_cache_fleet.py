"""The fleet cache inside real compiles: entries forged into Redis and into the
local directory never run, and a Redis that drips its replies cannot stall a
compile past the remote deadline. Each compile runs in a fresh process, as a
second machine would."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_redis import RedisServer

from loom_cache import MAGIC, CacheKey, Entry, encode_entry

KEY = "fleet-key-0123456789abcdef-current"
ATTACKER = b"attacker-key-0123456789abcdef"

_CHILD = r"""
import json, sys, torch, torchloom
from torchloom._models import GPTStack
torch.manual_seed(0)
model = GPTStack(32, 1, 4)
x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
out = torch.compile(model, backend="loom", options={"codegen": "eager"})(x)
out.float().pow(2).mean().backward()
rep = torchloom.report()
print("RESULT " + json.dumps({
    "cache": [e.kind for e in rep.entries("cache")],
    "messages": [e.message for e in rep.entries("cache")],
}))
"""


def _run(tmp: Path, **env: str) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHLOOM_")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={
            **base,
            "TORCHLOOM_CACHE_DIR": str(tmp / "loom"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


class _Payload:
    """Unpickling this creates ``marker`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (self.marker,))


def _key_of(data: bytes) -> CacheKey:
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    return CacheKey.from_json(header["key"])


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def test_forged_entries_in_redis_and_on_disk_never_run_in_a_compile(
    tmp_path: Path, redis_url: str
) -> None:
    import redis

    fleet = {"TORCHLOOM_REMOTE_CACHE": redis_url, "TORCHLOOM_CACHE_KEY": KEY}
    cold = _run(tmp_path / "a", **fleet)
    assert cold["cache"] == ["miss", "stored"]
    # The attacker can write Redis and the victim's cache directory, but has no key:
    # every stored entry is replaced by one whose payload runs code when unpickled.
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    client = redis.Redis.from_url(redis_url)
    forged = 0
    victim_dir = tmp_path / "b" / "loom" / "v1" / "entries"
    for i, name in enumerate(client.scan_iter(match="torchloom:v1:*")):
        key = _key_of(client.get(name))
        signer = None if i % 2 == 0 else ATTACKER
        data = encode_entry(Entry(key, evil), key=signer)
        client.set(name, data)
        path = victim_dir / key.digest[:2] / f"{key.digest}.entry"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_entry(Entry(key, evil)))
        forged += 1
    assert forged >= 1
    warm = _run(tmp_path / "b", **fleet)
    assert not marker.exists()  # 0 of the forged entries was unpickled
    assert warm["cache"] == ["miss", "stored"]  # refused, compiled cold, stored signed
    assert "corrupt entry" in warm["messages"][0]
    # And a third machine with the fleet key hits what b stored, signed.
    third = _run(tmp_path / "c", **fleet)
    assert third["cache"] == ["hit"] and not marker.exists()


class _DripServer:
    """Answers every request with a long Redis reply, one byte every ``interval`` s."""

    def __init__(self, interval: float = 0.3, length: int = 200) -> None:
        self.interval = interval
        self.reply = b"$%d\r\n" % length + b"x" * length + b"\r\n"
        self.sent = 0
        self.connections = 0
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self._sock.getsockname()[1]}/0"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not conn.recv(65536):
                    return
                for byte in self.reply:
                    if self._stop.wait(self.interval):
                        return
                    conn.sendall(bytes([byte]))
                    self.sent += 1
            except OSError:
                return  # the client stopped waiting

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


def test_a_dripping_redis_cannot_stall_a_compile(tmp_path: Path) -> None:
    server = _DripServer()
    try:
        result = _run(
            tmp_path,
            TORCHLOOM_REMOTE_CACHE=server.url,
            TORCHLOOM_CACHE_KEY=KEY,
            TORCHLOOM_REMOTE_CACHE_TIMEOUT="0.5",
        )
    finally:
        server.close()
    # Unbounded, the compile would have waited for every byte (60 s of dripping);
    # bounded, it gave up after a few and the breaker kept it from asking again.
    assert server.sent < len(server.reply)
    assert server.connections == 1
    assert result["cache"] == ["miss", "stored"]
    assert "remote unavailable" in result["messages"][0]
