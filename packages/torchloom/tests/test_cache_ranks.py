"""The ranks agreeing on each cache lookup (``torchloom/_cache_ranks.py``), in one
process: the other rank is a stand-in ``all_reduce`` (the two-process gloo test is
``tests_integration/test_cache_ranks.py``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloom
from torchloom import Pipeline
from torchloom._cache_ranks import CacheAgreement, agree_or_decide_alone, cache_agreement

EAGER = {"codegen": "eager"}


def _other_rank(hit: bool, same_key: bool = True) -> Any:
    """An ``all_reduce`` (MIN) with rank 1 of 2, whose lookup ``hit`` or missed."""

    def reduce_min(values: Sequence[int]) -> list[int]:
        first, low, neg_high = values
        other = low + 1 if not same_key else low
        return [min(first, 2 if hit else 1), min(low, other), min(neg_high, -other)]

    return reduce_min


class _Agreements:
    """A pipeline part: rank 0's agreement, and what ``cache_agree`` each compile asked."""

    def __init__(self, other_hit: bool) -> None:
        self.agreement = CacheAgreement(0, 2, _other_rank(other_hit))
        self.asked: list[bool] = []

    def __call__(self, enabled: bool) -> CacheAgreement | None:
        self.asked.append(enabled)
        return self.agreement if enabled else None


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2 + 1


def _compile_and_run(backend: Any, options: dict[str, Any]) -> torch.Tensor:
    torchloom.reset()
    out: torch.Tensor = torch.compile(_fn, backend=backend, options=options)(torch.ones(4))
    return out


def _cache() -> list[tuple[str, str]]:
    return [(e.kind, e.message) for e in torchloom.report().entries("cache")]


def test_the_lowest_missing_rank_and_key_equality_are_agreed() -> None:
    both_hit = CacheAgreement(0, 2, _other_rank(hit=True)).agree("ab" * 32, True)
    assert both_hit.hit and both_hit.missed_rank is None and both_hit.same_key
    other_missed = CacheAgreement(0, 2, _other_rank(hit=False)).agree("ab" * 32, True)
    assert not other_missed.hit and other_missed.missed_rank == 1
    both_missed = CacheAgreement(0, 2, _other_rank(hit=False)).agree("ab" * 32, False)
    assert both_missed.missed_rank == 0  # the lowest rank that missed


def test_ranks_with_different_keys_are_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    agreement = CacheAgreement(0, 2, _other_rank(hit=True, same_key=False))
    with caplog.at_level(logging.WARNING, logger="torchloom.cache"):
        assert not agreement.agree("ab" * 32, True).same_key
        agreement.agree("cd" * 32, True)
    warnings = [r.getMessage() for r in caplog.records if "different cache keys" in r.message]
    assert len(warnings) == 1 and "TORCHLOOM_CACHE_AGREE=0" in warnings[0]


def test_a_hit_here_is_compiled_when_another_rank_missed() -> None:
    want = _fn(torch.ones(4))
    _compile_and_run("loom", EAGER)  # fills this process's cache
    parts = _Agreements(other_hit=False)
    got = _compile_and_run(Pipeline(agreement=parts), EAGER)
    kinds = [k for k, _ in _cache()]
    assert kinds == ["agreed", "miss", "stored"]
    assert "rank 1 missed: every rank compiles" in _cache()[0][1]
    assert "a hit on this rank, but rank 1 missed, so every rank compiles" in _cache()[1][1]
    assert {s.name for g in torchloom.report() for s in g.stages} >= {"cache.agree", "aot"}
    torch.testing.assert_close(got, want)
    assert parts.asked == [True] and parts.agreement.calls == 1


def test_every_rank_hit_is_served() -> None:
    _compile_and_run("loom", EAGER)
    got = _compile_and_run(Pipeline(agreement=_Agreements(other_hit=True)), EAGER)
    assert [k for k, _ in _cache()] == ["agreed", "hit"]
    assert "all 2 ranks hit" in _cache()[0][1]
    torch.testing.assert_close(got, _fn(torch.ones(4)))


def test_a_miss_here_stays_a_miss_and_the_entry_is_stored() -> None:
    parts = _Agreements(other_hit=True)
    _compile_and_run(Pipeline(agreement=parts), EAGER)
    assert [k for k, _ in _cache()] == ["agreed", "miss", "stored"]
    assert "rank 0 missed" in _cache()[0][1]


def test_option_off_agrees_nothing_and_serves_the_local_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _compile_and_run("loom", EAGER)
    parts = _Agreements(other_hit=False)
    _compile_and_run(Pipeline(agreement=parts), {**EAGER, "cache_agree": False})
    assert [k for k, _ in _cache()] == ["hit"] and parts.agreement.calls == 0
    monkeypatch.setenv("TORCHLOOM_CACHE_AGREE", "0")
    _compile_and_run(Pipeline(agreement=parts), EAGER)
    assert [k for k, _ in _cache()] == ["hit"] and parts.asked == [False, False]


def test_cache_off_agrees_nothing_and_a_bypassing_graph_agrees_as_a_miss() -> None:
    parts = _Agreements(other_hit=True)
    _compile_and_run(Pipeline(agreement=parts), {**EAGER, "cache": False})
    assert [k for k, _ in _cache()] == ["bypass"] and parts.agreement.calls == 0

    sink: list[Any] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sink.append(object())  # a closure with no process-stable hash
        return t

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return torch.compile(_fn, backend=Pipeline(agreement=parts), options=EAGER)(x)

    torchloom.reset()
    step(torch.ones(4, requires_grad=True)).sum().backward()
    kinds = [k for k, _ in _cache()]
    assert kinds == ["bypass", "agreed"] and parts.agreement.calls == 1
    assert "rank 0 missed" in _cache()[1][1]


def test_a_failed_agreement_lets_the_rank_decide_alone(caplog: pytest.LogCaptureFixture) -> None:
    def broken(values: Sequence[int]) -> list[int]:
        raise RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation\nmore")

    with caplog.at_level(logging.WARNING, logger="torchloom.cache"):
        assert agree_or_decide_alone(CacheAgreement(1, 2, broken), "ab" * 32, True) is None
    assert "rank 1 could not agree" in caplog.text
    assert "RuntimeError: [gloo] Timed out waiting 1800000ms for recv operation" in caplog.text


def test_no_agreement_without_torch_distributed_or_with_one_rank(tmp_path: Path) -> None:
    import torch.distributed as dist

    assert cache_agreement(True) is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert cache_agreement(True) is None
    finally:
        dist.destroy_process_group()


def test_ranks_on_their_own_gpus_compare_the_same_neutral_key() -> None:
    """Each rank's key names its own device (``cuda:0``, ``cuda:1``), so the keys
    differ; what the ranks compare must not, or every multi-GPU job is warned about
    (seen on 2xH100 with FSDP2). A different program or option still differs."""
    import loom_cache
    from torchloom._cache_ranks import rank_neutral_digest

    def key(device: str, program: str = "model.py:3:forward#0", option: str = "a") -> Any:
        return loom_cache.CacheKey(
            program,
            (
                loom_cache.KeyComponent("graph", loom_cache.stable_digest(device), "12 nodes"),
                loom_cache.KeyComponent.of("inputs", [("f32", (2, 3), device)]),
                loom_cache.KeyComponent.of("values", device),
                loom_cache.KeyComponent.of("options", option),
            ),
        )

    rank0, rank1 = key("cuda:0"), key("cuda:1")
    assert rank0.digest != rank1.digest
    assert rank_neutral_digest(rank0) == rank_neutral_digest(rank1)
    assert rank_neutral_digest(key("cuda:0", program="model.py:9:forward#1")) != (
        rank_neutral_digest(rank0)
    )
    assert rank_neutral_digest(key("cuda:0", option="b")) != rank_neutral_digest(rank0)
