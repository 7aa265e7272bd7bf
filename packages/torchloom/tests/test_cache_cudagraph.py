"""The cache stage with CUDA graphs on: the plan is plain data that round-trips,
its settings (effective options, op registry) are in the key, and a second
process hits without tracing or planning, re-making the same report entries and
skip messages and running the same captured segments (``HostCapturer`` stands in
for CUDA graphs on CPU; the CUDA version is in tests_integration/test_cache_e2e.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import loom_cache
import loom_cudagraph
import torchloom
from torchloom import Pipeline
from torchloom._cache import Artifact

CG = {"codegen": "eager", "cudagraphs": True}


def _host(capturer: loom_cudagraph.HostCapturer) -> Pipeline:
    """A pipeline that captures host graphs with ``capturer`` (CPU stands in for CUDA)."""
    return Pipeline(capturer=capturer, cudagraph_device="cpu")


@pytest.fixture
def host_stage() -> Iterator[loom_cudagraph.HostCapturer]:
    capturer = loom_cudagraph.HostCapturer()
    loom_cudagraph.mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
    torchloom.reset()
    loom_cudagraph.reset_skip_counts()
    yield capturer
    loom_cudagraph.unmark_non_capturable(torch.ops.aten.sin)
    loom_cudagraph.unmark_non_capturable(torch.ops.aten.cos)
    torchloom.reset()


def _cache_kinds() -> list[str]:
    return [e.kind for e in torchloom.report().entries("cache")]


def _cudagraph_entries() -> list[tuple[str, str, tuple[tuple[str, Any], ...]]]:
    return [(e.kind, e.message, e.data) for e in torchloom.report().entries("cudagraph")]


def test_plan_round_trips_with_every_decision_and_reason() -> None:
    loom_cudagraph.mark_non_capturable(torch.ops.aten.sin, "stands in for a host op", "a hint")
    try:

        def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = (x @ w).relu()
            return y.sin() * 2, y.nonzero(), x.shape[0] * y

        gm = make_fx(f)(torch.randn(3, 4), torch.randn(4, 4))
        inputs = [torch.randn(3, 4), torch.randn(4, 4)]
        options = loom_cudagraph.CudagraphOptions(max_recording=3, min_segment_nodes=2)
        plan = loom_cudagraph.plan_graph(gm, inputs, (1,), options, name="g", device="cpu")
    finally:
        loom_cudagraph.unmark_non_capturable(torch.ops.aten.sin)
    kinds = {r.kind for s in plan.segments for r in s.reasons}
    assert loom_cudagraph.CudagraphRefusalKind.USER_MARKED in kinds
    assert loom_cudagraph.CudagraphRefusalKind.DATA_DEPENDENT_SHAPE in kinds
    assert plan.captured_segments

    again = loom_cudagraph.PartitionPlan.from_json(plan.to_json())
    again.check()
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert [(s.captured, s.nodes, s.reasons) for s in again.segments] == [
        (s.captured, s.nodes, s.reasons) for s in plan.segments
    ]
    assert [str(r) for r in again.skips()] == [str(r) for r in plan.skips()]
    assert again.summary() == plan.summary()
    assert again.options == options
    # renaming (a hit in a process that numbers graphs differently) keeps the decisions
    renamed = dataclasses.replace(again, graph="graph 7 forward")
    assert renamed.segments == plan.segments and "graph 7 forward" in renamed.summary()


def _plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)


def test_cold_compile_stores_every_plan_as_plain_data(
    host_stage: loom_cudagraph.HostCapturer, tmp_path: Path
) -> None:
    lin = torch.nn.Linear(4, 4)
    f = torch.compile(lambda x: lin(x).sin().sum(), backend=_host(host_stage), options=CG)
    f(torch.randn(2, 4)).backward()
    assert _cache_kinds() == ["miss", "stored"]
    store = loom_cache.LocalStore(tmp_path / "loom-cache")
    (info,) = list(store.entries())
    found = store.lookup(info.key.digest).entry
    assert found is not None
    artifact = pickle.loads(found.payload)
    assert isinstance(artifact, Artifact)
    assert info.key.component("cudagraph") is not None
    ((name, payload),) = artifact.stages
    assert name == "cudagraph" and _plain(payload)
    stored = [dict(p) for p in payload]
    assert [(p["kind"], p["outcome"]) for p in stored] == [
        ("forward", "captured"),
        ("backward", "captured"),
    ]
    plans = [loom_cudagraph.PartitionPlan.from_json(p["plan"]) for p in stored]
    assert [str(r) for p in plans for r in p.skips()] == [
        e.message.split(": ", 1)[1]
        for e in torchloom.report().entries("cudagraph")
        if e.kind == "skip"
    ]
    assert not [e for e in artifact.entries if e[0] == "cudagraph"]  # re-made from the plans


def test_cudagraph_settings_enter_the_key_and_a_miss_names_them(
    host_stage: loom_cudagraph.HostCapturer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(options: dict[str, Any] = CG) -> str:
        torchloom.reset()
        f = torch.compile(
            lambda x: (x * 2).sin().cos().sum(), backend=_host(host_stage), options=options
        )
        f(torch.randn(3))
        entries = torchloom.report().entries("cache")
        return " | ".join(f"{e.kind}: {e.message}" for e in entries)

    assert run().startswith("miss")
    assert run().startswith("hit")
    loom_cudagraph.mark_non_capturable(torch.ops.aten.cos, "another host op")
    missed = run()
    assert missed.startswith("miss") and "cudagraph: rules:" in missed
    monkeypatch.setenv(loom_cudagraph.OR_ERROR_ENV, "1")
    with pytest.raises(Exception, match="cudagraph_or_error"):  # a miss: compiled, refused
        run()
    monkeypatch.delenv(loom_cudagraph.OR_ERROR_ENV)
    loom_cudagraph.unmark_non_capturable(torch.ops.aten.cos)
    assert run().startswith("hit")
    missed = run({**CG, "cudagraph_max_recording": 2})
    assert "cudagraph_max_recording: 5 -> 2" in missed and "cudagraph: max_recording" in missed


def test_or_error_from_the_environment_is_in_the_key() -> None:
    from torchloom._cudagraph import cudagraph_settings

    def settings(env: dict[str, str], **options: Any) -> Any:
        resolved = torchloom.resolve_options(options={**CG, **options}, env=env)
        return cudagraph_settings(resolved, None, None)

    plain = settings({})
    strict = settings({loom_cudagraph.OR_ERROR_ENV: "1"})
    assert plain is not None and strict is not None
    assert plain["or_error"] is False and strict["or_error"] is True
    assert settings({loom_cudagraph.OR_ERROR_ENV: "1"}, cudagraph_or_error=False) == plain
    assert settings({}, cudagraphs=False) is None  # without CUDA graphs, no component


_CHILD = r"""
import json, logging, sys
import torch, torchloom, loom_cudagraph

mode, phase, codegen = sys.argv[1:4]
capturer, parts = None, {}
if mode == "host":
    capturer = loom_cudagraph.HostCapturer()
    parts = {"capturer": capturer, "cudagraph_device": "cpu"}
    loom_cudagraph.mark_non_capturable(torch.ops.aten.sin, "stands in for a host op")
if phase == "warm":
    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not plan")
    parts["plan_graph"] = refuse

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("torchloom.cudagraph").addHandler(Keep())
logging.getLogger("torchloom.cudagraph").setLevel(logging.INFO)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
f = torch.compile(lambda x: model(x).sin().sum(), backend=torchloom.Pipeline(**parts),
                  options={"codegen": codegen, "cudagraphs": True})
outs = []
for i in range(3):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
    loss = f(x)
    loss.backward()
    outs.append(loss.item())
rep = torchloom.report()
print("RESULT " + json.dumps({
    "cache": [e.kind for e in rep.entries("cache")],
    "stages": sorted({s.name for g in rep for s in g.stages}),
    "cudagraph": [[e.kind, e.message, [list(kv) for kv in e.data]]
                  for e in rep.entries("cudagraph")],
    "skips": {k.value: v for k, v in loom_cudagraph.skip_counts().items()},
    "log": messages,
    "outs": outs,
    "grads": [p.grad.double().flatten().tolist() for p in model.parameters()],
    "replays": capturer.replays if capturer else 0,
    "stats": [s.format() for s in torchloom.cudagraph_stats()],
}))
"""


def _child(
    mode: str, phase: str, cache_dir: Path, codegen: str = "eager", inductor_dir: str = ""
) -> dict[str, Any]:
    env = {"TORCHLOOM_CACHE_DIR": str(cache_dir), "PYTHONHASHSEED": "1" if phase == "cold" else "2"}
    if inductor_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, phase, codegen],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def _assert_warm_is_cold(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    assert cold["cache"] == ["miss", "stored"] and warm["cache"] == ["hit"]
    assert "partition" in cold["stages"]
    assert "partition" not in warm["stages"]
    assert not any(s.startswith("codegen") for s in warm["stages"])
    assert warm["cudagraph"] == cold["cudagraph"]
    assert warm["skips"] == cold["skips"]
    assert warm["log"] == cold["log"]
    assert warm["outs"] == cold["outs"]  # bitwise: the hit runs the cold compile's code
    assert warm["grads"] == cold["grads"]
    assert warm["stats"] == cold["stats"]


def test_second_process_rebuilds_the_captured_runtime_with_the_same_report(
    tmp_path: Path,
) -> None:
    cold = _child("host", "cold", tmp_path)
    warm = _child("host", "warm", tmp_path)
    _assert_warm_is_cold(cold, warm)
    kinds = [k for k, _, _ in warm["cudagraph"]]
    assert "segment" in kinds and "skip" in kinds and "recording" in kinds
    assert warm["skips"] == {"user_marked": 1}
    assert any("running uncaptured" in m and "stands in for a host op" in m for m in warm["log"])
    assert warm["replays"] == cold["replays"] > 0


# NOTE: test_second_process_rebuilds_the_captured_runtime_with_the_same_report covers the
# cross-process reload on the newest release; this one runs on the locked torch only.
@pytest.mark.fresh_processes
def test_second_process_on_a_cpu_only_machine_hits_with_the_same_plan_entries(
    tmp_path: Path,
) -> None:
    # The real stage on CPU tensors: plans whose segments say why nothing is captured.
    cold = _child("cuda", "cold", tmp_path)
    warm = _child("cuda", "warm", tmp_path)
    _assert_warm_is_cold(cold, warm)
    segments = [dict(map(tuple, data)) for kind, _, data in warm["cudagraph"] if kind == "segment"]
    assert [s["graph"] for s in segments] == ["graph 0 forward", "graph 0 backward"]
    assert all(not s["captured"] and "cpu_tensor" in s["reasons"] for s in segments)


@pytest.mark.inductor
@pytest.mark.fresh_processes
def test_inductor_segments_reload_without_inductors_own_cache(tmp_path: Path) -> None:
    # The warm process gets an empty Inductor cache: the segments' generated code
    # comes from loom's artifact alone.
    cold = _child("host", "cold", tmp_path / "loom", "inductor", str(tmp_path / "inductor-a"))
    warm = _child("host", "warm", tmp_path / "loom", "inductor", str(tmp_path / "inductor-b"))
    _assert_warm_is_cold(cold, warm)
    assert warm["replays"] == cold["replays"] > 0
