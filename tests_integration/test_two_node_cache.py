"""Two "nodes" on one host sharing the Redis cache tier: ``scripts/two_node_cache.sh``.

On CPU the script launches two ``torch.distributed.run --nnodes 2`` agents at once
(one rank each, gloo), each node with a local loom cache and Inductor/Triton caches
of its own and one redis-server on loopback; the first run must miss and store on
every rank, the second, with fresh local caches, must hit on every rank (through
Redis). On four GPUs the same script runs two ranks per node with NCCL (see
docs/distributed.md, "Multi-node"). The script finds the Redis server through
``scripts/local_redis.py``, as the fixtures do.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from local_redis import find_redis_server

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = ROOT / "scripts" / "two_node_cache.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.fresh_processes
def test_two_nodes_fill_the_shared_tier_then_hit_it_on_every_rank() -> None:
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PYTHON": sys.executable,
        "REDIS_SERVER": str(find_redis_server()),
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
