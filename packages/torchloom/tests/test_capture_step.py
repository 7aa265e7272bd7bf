"""``torchloom.capture_step``: loom_step's capture with loom's options and report
(the step itself is tested in packages/step/tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import loom_cache
import loom_cudagraph
import loom_step
import torchloom
from torchloom._capture_step import resolve_step_options

HERE = __file__


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _make_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def test_capture_step_is_loom_steps_with_its_types_reexported() -> None:
    model = _mlp()
    step = torchloom.capture_step(_make_step(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    assert isinstance(step, loom_step.CapturedStep)
    assert torchloom.CapturedStep is loom_step.CapturedStep
    assert torchloom.StepUnsupported is loom_step.StepUnsupported
    assert torchloom.CaptureStepError is loom_step.CaptureStepError
    assert step.__name__ == "train_step"


def test_no_cuda_reason_is_in_the_report_once_and_never_raises_under_or_error() -> None:
    torchloom.reset()
    model = _mlp()
    step = torchloom.capture_step(
        _make_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), cudagraph_or_error=True
    )
    assert step.options.or_error
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        step(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    if torch.cuda.is_available():
        return
    entries = torchloom.report().entries("capture_step")
    assert [e.kind for e in entries] == ["refused"]
    assert entries[0].get("kind_") == "no_cuda"
    assert f"{HERE}:" in entries[0].get("where")
    assert "train_step" in entries[0].message
    assert entries[0].refusal is step.stats().refusal
    (record,) = [r for r in torchloom.report() if r.name.startswith("capture_step")]
    assert dict(record.options)["capture_step_warmup"] == 3


def test_report_entries_of_a_host_captured_step() -> None:
    """Recordings and a spent budget reach the report through the step's listener."""
    torchloom.reset()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = torchloom.capture_step(
        _make_step(model, opt), capture_step_warmup=1, capture_step_max_recordings=1
    )
    step.capturer = loom_cudagraph.HostCapturer()
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        step(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        if i >= 2:  # a float lr stepped after the capture: a new guard set per call
            opt.param_groups[0]["lr"] *= 0.9
    kinds = [e.kind for e in torchloom.report().entries("capture_step")]
    assert kinds == ["recorded", "budget"], kinds
    budget = torchloom.report().entries("capture_step")[1]
    assert budget.get("kind_") == "recording_budget"
    assert step.stats().recordings == 1 and step.stats().budget_skips == 3


def test_unknown_option_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(torchloom.LoomOptionsError, match="capture_step_warmup"):
        torchloom.capture_step(lambda: None, capture_step_warmpu=2)


def test_warmup_and_budget_must_be_positive() -> None:
    with pytest.raises(torchloom.LoomOptionsError, match=r"capture_step_warmup.*at least 1"):
        torchloom.capture_step(lambda: None, capture_step_warmup=0)
    with pytest.raises(torchloom.LoomOptionsError, match="expected int"):
        torchloom.capture_step(lambda: None, capture_step_max_recordings="2")
    with pytest.raises(torchloom.LoomOptionsError, match="expected an integer"):
        resolve_step_options({}, env={"TORCHLOOM_CAPTURE_STEP_WARMUP": "three"})


def test_options_resolve_env_below_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHLOOM_CAPTURE_STEP_WARMUP", "7")
    monkeypatch.setenv("TORCHLOOM_CAPTURE_STEP_MAX_RECORDINGS", "2")
    step = torchloom.capture_step(lambda: None, capture_step_max_recordings=3)
    assert step.options == loom_step.StepOptions(warmup=7, max_recordings=3, or_error=False)


def test_capture_step_options_are_no_backend_option() -> None:
    """The step's options live in their own value: torch.compile refuses them, and loom's
    options (which every cache key records) have no field of theirs."""
    assert not [f for f in torchloom.LoomOptions.__dataclass_fields__ if "capture_step" in f]
    with pytest.raises(torchloom.LoomOptionsError, match="capture_step_warmup"):
        torchloom.resolve_options(options={"capture_step_warmup": 2}, env={})


def _cache_key() -> loom_cache.CacheKey:
    torchloom.reset()
    f = torch.compile(lambda x: x.sin() * 2, backend="loom", options={"codegen": "eager"})
    f(torch.randn(4))
    (record,) = torchloom.report()
    key = record.plan("cache")
    assert isinstance(key, loom_cache.CacheKey), key
    return key


def test_changing_capture_step_warmup_does_not_change_a_graphs_cache_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = []
    for value in ("3", "7"):
        monkeypatch.setenv("TORCHLOOM_CAPTURE_STEP_WARMUP", value)
        monkeypatch.setenv("TORCHLOOM_CAPTURE_STEP_MAX_RECORDINGS", value)
        keys.append(_cache_key())
    assert keys[0].digest == keys[1].digest
    assert "capture_step" not in str(keys[0].component("options"))
    torchloom.reset()
