"""``benchmarks/bench_scale.py``'s CPU smoke: two gloo ranks under torchrun.

The benchmark's real run is a 1B Llama under FSDP2 on GPUs; here the same code
path runs a 2-layer Llama on CPU (``--smoke``: eager codegen, both regimes, one
step per round), so the harness (FSDP2 per decoder layer, the per-variant switch
of the layers' compiled forward, interleaved rounds, the rows) keeps working.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_scale.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _smoke() -> list[dict[str, Any]]:
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(_free_port())),
        *(str(SCRIPT), "--smoke"),
    ]
    # NOTE: one thread per rank: two ranks share a small machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    prefix = "SCALE_RESULT "
    return [
        json.loads(ln[len(prefix) :]) for ln in proc.stdout.splitlines() if ln.startswith(prefix)
    ]


def test_bench_scale_smoke_runs_every_cpu_variant_in_both_regimes_on_two_ranks() -> None:
    rows = {(r["regime"], r["variant"]): r for r in _smoke()}
    variants = (
        *("eager", "inductor", "loom", "loom-cg", "capture_step"),
        *("full-inductor", "full-loom"),
    )
    assert set(rows) == {(g, v) for g in ("compute", "strong") for v in variants}
    for regime in ("compute", "strong"):
        for variant in ("eager", "loom", "capture_step"):
            r = rows[regime, variant]
            assert r["world"] == 2, r
            assert r["step_ms"] > 0 and r["tok_s"] == 2 * r["tok_s_gpu"] > 0, r
            # the spread over rounds: min <= q1 <= median <= q3 <= max
            assert r["rounds"] == 2, r
            assert r["min_ms"] <= r["q1_ms"] <= r["step_ms"] <= r["q3_ms"] <= r["max_ms"], r
        for variant in ("full-inductor", "full-loom"):  # traceable FSDP2: GPU only
            assert "GPU only" in rows[regime, variant]["note"], rows[regime, variant]
        # the decoder layers share one compiled forward: one Dynamo graph for both
        # layers, none fell back to eager
        loom = rows[regime, "loom"]
        assert loom["loom_graphs"] == 1 and loom["fallbacks"] == 0, loom
        assert loom["vs_inductor"] is None  # Inductor is not run on CPU
        assert "GPU only" in rows[regime, "loom-cg"]["note"]
        assert "not run on CPU" in rows[regime, "inductor"]["note"]
        # capture_step has no CUDA device here: it ran the step uncaptured, and says so
        assert "uncaptured" in rows[regime, "capture_step"]["note"]
        assert rows[regime, "eager"]["note"] is None and loom["note"] is None
    assert rows["compute", "eager"]["batch"] == "2x16"
    assert rows["strong", "eager"]["batch"] == "1x8"
