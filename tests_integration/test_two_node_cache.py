"""Two "nodes" on one host sharing the Redis cache tier: ``scripts/two_node_cache.sh``.

On CPU the script launches two ``torch.distributed.run --nnodes 2`` agents at once
(one rank each, gloo), each node with a local loom cache and Inductor/Triton caches
of its own and one redis-server on loopback; the first run must miss and store on
every rank, the second, with fresh local caches, must hit on every rank (through
Redis). On four GPUs the same script runs two ranks per node with NCCL (see
docs/distributed.md, "Multi-node"). ``scripts/unpack_redis.sh`` makes a
redis-server from .deb files for a machine without one.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = ROOT / "scripts" / "two_node_cache.sh"
UNPACK = ROOT / "scripts" / "unpack_redis.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.fresh_processes
def test_two_nodes_fill_the_shared_tier_then_hit_it_on_every_rank() -> None:
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(server).exists():
        pytest.fail("redis-server is not installed (the CI script installs it)")
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PYTHON": sys.executable,
        "REDIS_SERVER": server,
        "RDZV_PORT": str(_free_port()),
        "REDIS_PORT": str(_free_port()),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        ["bash", str(TWO_NODES)], env=env, capture_output=True, text=True, timeout=1200
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    counts = re.findall(r"run (\d): \[cache\] rank (\d) node (\d) .*: hit (\d+) miss (\d+)", out)
    by_run = {
        run: {
            (int(rank), int(node)): (int(h), int(m)) for r, rank, node, h, m in counts if r == run
        }
        for run in ("1", "2")
    }
    # rank 0 on node 0, rank 1 on node 1: two launches, one rank each
    assert set(by_run["1"]) == set(by_run["2"]) == {(0, 0), (1, 1)}, out
    assert all(m > 0 for _, m in by_run["1"].values()), out
    assert all(h > 0 and m == 0 for h, m in by_run["2"].values()), out
    assert "two-node cache: PASS" in out


def test_unpack_redis_refuses_a_directory_without_packages(tmp_path: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed")
    proc = subprocess.run(
        ["bash", str(UNPACK), str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"no .deb files in {tmp_path}" in proc.stderr
