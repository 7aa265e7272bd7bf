"""HookPair snapshots, their identity, their fingerprints, and how a pair is prepared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hook_modules as hm
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import loom_hops
from loom_hops import HookPair, HopsRefusalKind


def test_the_snapshot_is_the_innermost_active_pair() -> None:
    assert loom_hops.active_saved_tensors_hooks() is None
    outer, inner = hm.bf16(), hm.fp8()
    with torch.autograd.graph.saved_tensors_hooks(*outer):
        with torch.autograd.graph.saved_tensors_hooks(*inner):
            pair = loom_hops.active_saved_tensors_hooks()
            assert pair is not None and pair.pack is inner[0] and pair.is_active()
        assert pair.kind == "graph_module" and not pair.is_active()


def test_kinds_of_pairs() -> None:
    gm_pack, gm_unpack = hm.bf16()
    assert HookPair(gm_pack, gm_unpack).kind == "graph_module"
    assert HookPair(lambda x: x, lambda x: x).kind == "python"
    assert HookPair(gm_pack, lambda x: x).kind == "mixed"


SCALE = torch.tensor(2.0)
KEPT: list[torch.Tensor] = []


def _reads_a_global_tensor(t: torch.Tensor) -> torch.Tensor:
    return t * SCALE


def _prints(t: torch.Tensor) -> torch.Tensor:
    print("packing")
    return t


def _keeps_the_tensor(t: torch.Tensor) -> torch.Tensor:
    KEPT.append(t)
    return t


@pytest.mark.parametrize(
    ("pack", "kind"),
    [
        (_prints, HopsRefusalKind.HOOK_NOT_TRACEABLE),
        (_keeps_the_tensor, HopsRefusalKind.HOOK_SIDE_EFFECTS_UNSUPPORTED),
    ],
)
def test_python_hooks_the_tracer_cannot_place_are_refused_with_where(
    pack: Any, kind: HopsRefusalKind
) -> None:
    graphs = loom_hops.prepare_saved_tensors_hooks(HookPair(pack, lambda t: t))
    assert not isinstance(graphs, loom_hops.Unsupported)
    with FakeTensorMode() as mode:
        saved = mode.from_tensor(torch.randn(4, 8))
    got = graphs.trace_pack(saved)
    assert isinstance(got, loom_hops.Unsupported)
    assert got.kind is kind and "test_saved_hooks.py" in got.where and got.hint


def test_a_tensor_a_hook_reads_from_its_globals_is_a_graph_input() -> None:
    graphs = loom_hops.prepare_saved_tensors_hooks(HookPair(_reads_a_global_tensor, lambda t: t))
    assert not isinstance(graphs, loom_hops.Unsupported)
    with FakeTensorMode() as mode:
        saved = mode.from_tensor(torch.randn(4, 8))
    got = graphs.trace_pack(saved)
    assert isinstance(got, loom_hops.TracedPack), got
    (lifted,) = got.lifted
    assert "SCALE" in lifted.key and lifted.example.shape == ()
    placeholders = [n for n in got.graph.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2  # the saved tensor and SCALE: no constant baked in
    pair = HookPair(_reads_a_global_tensor, lambda t: t)
    assert lifted.read(pair) is SCALE


def test_a_custom_tracer_is_asked_for_python_hooks() -> None:
    seen = []

    def tracer(pair: HookPair, decompositions: Any) -> loom_hops.Unsupported:
        seen.append(pair)
        return loom_hops.Unsupported(HopsRefusalKind.HOOK_TRACE_FAILED, "here", "no")

    pair = HookPair(lambda x: x, lambda x: x)
    got = loom_hops.prepare_saved_tensors_hooks(pair, python_tracer=tracer)
    assert seen == [pair] and isinstance(got, loom_hops.Unsupported)


def test_mixed_pairs_are_refused() -> None:
    got = loom_hops.prepare_saved_tensors_hooks(HookPair(hm.bf16()[0], lambda x: x))
    assert isinstance(got, loom_hops.Unsupported) and got.kind is HopsRefusalKind.MIXED_HOOK_KINDS


def test_graph_module_fingerprints_follow_content_not_identity() -> None:
    a, b, c = HookPair(*hm.bf16()), HookPair(*hm.bf16()), HookPair(*hm.fp8())
    fa = loom_hops.fingerprint_hooks(a)
    assert fa is not None and fa == loom_hops.fingerprint_hooks(b)
    assert fa != loom_hops.fingerprint_hooks(c)
    assert loom_hops.fingerprint_hooks(None) == "no-hooks"


def test_opaque_calls_need_a_user_cache_hash_or_bypass() -> None:
    pack, unpack = hm.deciding()
    assert loom_hops.fingerprint_hooks(HookPair(pack, unpack)) is not None
    bare = torch.fx.symbolic_trace(hm.DecidingPack())
    assert loom_hops.fingerprint_hooks(HookPair(bare, unpack)) is None


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import hook_modules as hm, loom_hops;"
        "print(loom_hops.fingerprint_hooks(loom_hops.HookPair(*hm.fp8())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()
    here = loom_hops.fingerprint_hooks(HookPair(*hm.fp8()))
    assert here is not None and len(here) == 64 and other == here
