"""``benchmarks/bench_offload.py`` runs on the CPU (its smoke run): the ``save_on_cpu``
row, eager against loom, gradients compared, nothing appended to the results (the stream
pair on the CPU is ``packages/torchloom/tests/test_hooks.py``'s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_offload_smoke_run() -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_offload.py"),
            "--device",
            "cpu",
            "--quick",
            "--no-append",
            "--rows",
            "save_on_cpu",
            "--backends",
            "eager,loom",
            "--rounds",
            "1",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    cells = {tuple(c.strip() for c in line.split("|")[1:3]) for line in table[1:]}
    assert {("save_on_cpu", "eager"), ("save_on_cpu", "loom")} <= cells
    assert "error" not in table[0], proc.stdout
