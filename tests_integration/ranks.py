"""Run one worker script as two gloo ranks in fresh processes (the CPU tests of
rank-consistent behaviour): each rank prints JSON lines, which come back per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def run_ranks(
    worker: str,
    args: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]] = ({}, {}),
    timeout: float = 300,
    unset: Sequence[str] = (),
) -> list[list[Any]]:
    """``python -c worker *args[rank]`` for each rank, with ``envs[rank]`` over this
    process's environment (one OpenMP thread each); the JSON lines each printed, by
    rank. ``unset`` names variables of this environment the ranks must not see. A rank that fails fails the test with its stderr; a rank still running
    after ``timeout`` seconds is killed (a hang never outlives the test)."""
    base = {k: v for k, v in os.environ.items() if k not in unset}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, "OMP_NUM_THREADS": "1", **env},
        )
        for argv, env in zip(args, envs, strict=True)
    ]
    out: list[list[Any]] = []
    errors = []
    try:
        for rank, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(f"rank {rank} (rc {p.returncode}):\n{stderr[-3000:]}")
            out.append([json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")])
        assert not errors, "\n".join(errors)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out
