"""capture_step on the host: the uncaptured path against eager, the guard of each
kind, the refusals with the user's source line, and the captured path through
``loom_cudagraph.HostCapturer`` (on CUDA: tests_integration/test_capture_step.py,
marked gpu; loom's options and report: packages/torchloom/tests)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import loom_cudagraph
import loom_step
from loom_cudagraph import CudagraphRefusalKind
from loom_step import CapturedStep, StepOptions, StepState
from loom_step._guard import ANY_TENSOR, GuardKind, StepGuard, StepProbe
from loom_step._recording import Recording, protect_outputs
from loom_step._refusals import (
    SYNC_WARNING,
    StepRefusalKind,
    StepUnsupported,
    collect_syncs,
    optimizer_refusals,
    scaler_refusals,
    sync_refusal,
)
from loom_step._targets import find_targets
from loom_step._torch_compat import storage_counter, tree_flatten

HERE = __file__


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 1))


def _make_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def _batches(n: int, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)
    ]


def _guard(probe: StepProbe, *args: Any) -> StepGuard:
    leaves, tree = tree_flatten((args, {}))
    return probe.read(leaves, tree, named=True)


# --- the uncaptured path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    ],
    ids=["sgd_momentum", "adamw"],
)
def test_uncaptured_step_matches_eager_over_several_steps(make_opt: Any) -> None:
    eager_model, loom_model = _mlp(), _mlp()
    eager_step = _make_step(eager_model, make_opt(eager_model.parameters()))
    step = loom_step.capture_step(_make_step(loom_model, make_opt(loom_model.parameters())))
    for x, y in _batches(6):
        expected = eager_step(x, y)
        got = step(x, y)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for p, q in zip(eager_model.parameters(), loom_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    stats = step.stats()
    assert stats.uncaptured_calls == 6 and stats.replays == 0 and not stats.captured
    if not torch.cuda.is_available():
        assert stats.refusal is not None and stats.refusal.kind is StepRefusalKind.NO_CUDA


def test_returns_callable_with_the_steps_name_and_passes_kwargs_through() -> None:
    model = _mlp()
    inner = _make_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = loom_step.capture_step(inner)
    assert isinstance(step, CapturedStep) and step.state is StepState.NEW
    assert step.__name__ == "train_step" and step.__wrapped__ is inner  # type: ignore[attr-defined]
    x, y = _batches(1)[0]
    assert step(x=x, y=y).shape == ()


def test_no_cuda_reason_is_told_once_and_never_raises_under_or_error() -> None:
    model = _mlp()
    events: list[loom_step.StepEvent] = []
    step = loom_step.capture_step(
        _make_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        options=StepOptions(or_error=True),
        listener=events.append,
    )
    for x, y in _batches(3):
        step(x, y)
    if torch.cuda.is_available():
        return
    assert [e.kind for e in events] == ["refused"]
    reason = events[0].refusal
    assert reason is not None and reason.kind is StepRefusalKind.NO_CUDA and not reason.cuda_work
    assert f"{HERE}:" in reason.where and "train_step" in events[0].message
    assert step.stats().state is StepState.UNCAPTURED


def test_a_step_refused_from_outside_runs_uncaptured_with_that_reason() -> None:
    """``refuse`` (a trainer's setting a replay would not honour) is a refusal like the
    step's own: told once, in the stats, raised under ``or_error``; the first reason stays."""
    model = _mlp()
    events: list[loom_step.StepEvent] = []
    capturer = loom_cudagraph.HostCapturer()
    inner = _make_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = loom_step.capture_step(inner, capturer=capturer, listener=events.append)
    reason = StepUnsupported(
        StepRefusalKind.PYTHON_STATE, "trainer.py:7 in fit", "a hook runs in the step", "move it"
    )
    step.refuse(reason)
    step.refuse(dataclasses.replace(reason, explanation="another"))
    for x, y in _batches(5):
        step(x, y)
    stats = step.stats()
    assert stats.state is StepState.UNCAPTURED and stats.refusal is reason
    assert (stats.uncaptured_calls, stats.recordings, capturer.captures) == (5, 0, 0)
    assert [e.refusal for e in events] == [reason]
    strict = loom_step.capture_step(inner, options=StepOptions(or_error=True), capturer=capturer)
    with pytest.raises(loom_step.CaptureStepError, match="a hook runs in the step"):
        strict.refuse(reason)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"warmup must be an int >= 1"):
        StepOptions(warmup=0)
    with pytest.raises(ValueError, match=r"max_recordings must be an int >= 1"):
        StepOptions(max_recordings="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a callable"):
        loom_step.capture_step(3)  # type: ignore[arg-type]


# --- guards ----------------------------------------------------------------------------------


def _probe_setup() -> tuple[nn.Module, torch.optim.Optimizer, StepProbe, Callable[..., Any]]:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    fn = _make_step(model, opt)
    x, y = _batches(1)[0]
    fn(x, y)  # optimizer state exists
    return model, opt, StepProbe(find_targets(fn)), fn


def test_guard_holds_for_an_unchanged_call() -> None:
    _, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    assert _guard(probe, x, y).mismatch(_guard(probe, x.clone(), y.clone())) is None


@pytest.mark.parametrize(
    ("change", "kind", "detail"),
    [
        (lambda x, y: ((x[:8], y[:8]), None), GuardKind.ARGUMENTS, "float32[8, 4]"),
        (lambda x, y: ((x.double(), y), None), GuardKind.ARGUMENTS, "float64"),
        (lambda x, y: ((x, y, 3), None), GuardKind.ARGUMENTS, "structure"),
    ],
    ids=["batch", "dtype", "structure"],
)
def test_argument_guard(change: Any, kind: GuardKind, detail: str) -> None:
    _, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    args, _ = change(x, y)
    found = _guard(probe, x, y).mismatch(_guard(probe, *args))
    assert found is not None and found.kind is kind and detail in found.detail


def test_non_tensor_argument_is_guarded_by_value() -> None:
    _, _, probe, _ = _probe_setup()
    x, _ = _batches(1)[0]
    assert _guard(probe, x, 2).mismatch(_guard(probe, x, 2)) is None
    found = _guard(probe, x, 2).mismatch(_guard(probe, x, 3))
    assert found is not None and found.kind is GuardKind.ARGUMENTS and "('int', 3)" in found.detail


def test_grad_mode_and_autocast_are_guarded() -> None:
    _, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    with torch.no_grad():
        no_grad = _guard(probe, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _guard(probe, x, y)
    found = base.mismatch(no_grad)
    assert found is not None and found.kind is GuardKind.MODES and "grad mode" in found.detail
    found = base.mismatch(autocast)
    assert found is not None and found.kind is GuardKind.MODES and "CPU autocast" in found.detail


def test_replaced_parameter_is_an_object_change_naming_it() -> None:
    model, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    model[3].weight = nn.Parameter(model[3].weight.detach().clone())
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.OBJECTS
    assert "model.3.weight" in found.detail


def test_replaced_submodule_is_an_object_change() -> None:
    model, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    model[1] = nn.GELU()
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.OBJECTS and "model.1" in found.detail


def test_rebound_closure_tensor_is_an_object_change() -> None:
    scale = torch.ones(3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    probe = StepProbe(find_targets(fn))
    base = _guard(probe, torch.ones(3))
    scale = torch.full((3,), 2.0)  # rebinds the closure cell
    found = base.mismatch(_guard(probe, torch.ones(3)))
    assert found is not None and found.kind is GuardKind.OBJECTS and "scale" in found.detail


def test_moved_parameter_data_is_an_address_change() -> None:
    model, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    model[0].bias.data = model[0].bias.data.clone()
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.ADDRESSES
    assert "model.0.bias" in found.detail


def test_frozen_parameter_is_a_requires_grad_change() -> None:
    model, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    model[0].weight.requires_grad_(False)
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.REQUIRES_GRAD


def test_float_hyperparameter_change_is_detected_and_a_tensor_lr_change_is_not() -> None:
    _, opt, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    opt.param_groups[0]["lr"].fill_(0.5)  # a tensor lr: a replay reads its value
    assert base.mismatch(_guard(probe, x, y)) is None
    opt.param_groups[0]["weight_decay"] = 0.5
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.HYPERPARAMETERS
    assert "['weight_decay'] was 0.01 at capture, is 0.5 now" in found.detail


def test_replaced_optimizer_state_is_an_object_change() -> None:
    model, opt, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    base = _guard(probe, x, y)
    p = next(model.parameters())
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
    found = base.mismatch(_guard(probe, x, y))
    assert found is not None and found.kind is GuardKind.OBJECTS and "exp_avg" in found.detail


def test_gradient_expectations() -> None:
    _, _, probe, _ = _probe_setup()
    x, y = _batches(1)[0]
    params = probe.params
    for p in params:
        p.grad = None
    none = _guard(probe, x, y)
    for p in params:
        p.grad = torch.zeros_like(p)
    have = _guard(probe, x, y)
    found = none.mismatch(have)
    assert (
        found is not None and found.kind is GuardKind.GRADIENTS and "another tensor" in found.detail
    )
    found = have.mismatch(none)
    assert (
        found is not None and found.kind is GuardKind.GRADIENTS and ".grad is None" in found.detail
    )
    # A step that replaces its gradients (zero_grad(set_to_none=True) first) accepts any tensor.
    replaced = StepGuard(**{**_fields(have), "grads": tuple(ANY_TENSOR for _ in params)})
    params[0].grad = torch.ones_like(params[0])
    assert replaced.mismatch(_guard(probe, x, y)) is None
    assert replaced.mismatch(none) is not None


def _fields(g: StepGuard) -> dict[str, Any]:
    return {f: getattr(g, f) for f in StepGuard.__dataclass_fields__}


# --- targets -----------------------------------------------------------------------------------


class _Trainer:
    def __init__(self) -> None:
        self.model = _mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).sum()
        loss.backward()
        self.opt.step()
        return loss


def test_targets_of_a_bound_method_and_track() -> None:
    trainer = _Trainer()
    targets = find_targets(trainer.step)
    assert [n for n, _ in targets.modules] == ["self.model"]
    assert [n for n, _ in targets.optimizers] == ["self.opt"]
    extra = nn.Linear(2, 2)
    assert any(m is extra for _, m in find_targets(lambda: None, [extra]).modules)


# --- refusals ----------------------------------------------------------------------------------


def _line_of(fn: Callable[..., Any], needle: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(k for k, line in enumerate(lines) if needle in line)


def test_non_capturable_adamw_is_refused_at_the_users_step_line() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), capturable=False)
    fn = _make_step(model, opt)
    (reason,) = optimizer_refusals(fn, find_targets(fn), device_type="cpu")
    assert reason.kind is StepRefusalKind.OPTIMIZER_NOT_CAPTURABLE
    assert reason.where.startswith(f"{HERE}:{_line_of(_make_step, 'opt.step(')} in train_step")
    assert "capturable=True" in reason.hint and reason.op == "opt.step()"
    capturable = torch.optim.AdamW(model.parameters(), capturable=True)
    fn2 = _make_step(model, capturable)
    assert optimizer_refusals(fn2, find_targets(fn2), device_type="cpu") == []


def test_sgd_is_capturable_and_adagrad_lbfgs_are_refused() -> None:
    model = _mlp()
    for opt, refused in (
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), False),
        (torch.optim.Adagrad(model.parameters()), True),
        (torch.optim.LBFGS(model.parameters()), True),
    ):
        fn = _make_step(model, opt)
        found = optimizer_refusals(fn, find_targets(fn), device_type="cpu")
        assert bool(found) is refused, type(opt).__name__


def test_enabled_grad_scaler_is_refused() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def amp_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    (reason,) = scaler_refusals(amp_step, find_targets(amp_step))
    assert reason.kind is StepRefusalKind.GRAD_SCALER
    assert reason.where.startswith(f"{HERE}:{_line_of(amp_step, 'scaler.step(')} in amp_step")


def test_sync_refusal_names_the_users_line_and_op() -> None:
    def step_with_item(x: torch.Tensor) -> list[traceback.FrameSummary]:
        stack = traceback.extract_stack()  # stands for the warning hook, inside .item()
        return stack

    stack = step_with_item(torch.ones(1))
    reason = sync_refusal(stack)
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP
    line = _line_of(step_with_item, "stack = traceback.extract_stack()")
    assert reason.where == f"{HERE}:{line} in step_with_item"
    assert reason.op.startswith("stack = traceback.extract_stack()")
    assert f"[sync_op] {HERE}:{line} in step_with_item: stack = " in str(reason)


def test_sync_warning_becomes_a_refusal_at_the_users_line() -> None:
    import warnings

    def step_with_sync(x: torch.Tensor) -> torch.Tensor:
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)  # what .item() issues
        return x

    found: list[Any] = []
    with collect_syncs(found):
        step_with_sync(torch.ones(1))
    (reason,) = found
    line = _line_of(step_with_sync, "warnings.warn(")
    assert reason.where == f"{HERE}:{line} in step_with_sync"
    assert reason.op.startswith("warnings.warn(SYNC_WARNING")


def test_other_warnings_are_still_shown() -> None:
    import warnings

    found: list[Any] = []
    with pytest.warns(UserWarning, match="unrelated"), collect_syncs(found):
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert found == []


def test_sync_from_compile_machinery_is_not_the_steps() -> None:
    frames = [
        traceback.FrameSummary(HERE, 1, "user"),
        traceback.FrameSummary("/x/torch/_inductor/autotune_process.py", 2, "bench"),
    ]
    assert sync_refusal(frames) is None


def test_or_error_message_names_the_step_and_the_switch() -> None:
    reason = loom_step.StepUnsupported(
        StepRefusalKind.SYNC_OP, "train.py:3 in step", "waits", "keep .item() out", "loss.item()"
    )
    err = loom_step.CaptureStepError(reason, "train_step")
    assert (
        "capture_step train_step runs uncaptured: [sync_op] train.py:3 in step: loss.item(): "
        "waits (hint: keep .item() out)" in str(err)
    )
    # The text is the shared refusal format (loom_sidefx.Refusal), the op leading the why.
    from loom_sidefx import Refusal as Base

    plain = loom_step.StepUnsupported(StepRefusalKind.SYNC_OP, "train.py:3 in step", "waits", "h")
    assert str(plain) == Base.__str__(plain) == "[sync_op] train.py:3 in step: waits (hint: h)"
    assert "TORCHLOOM_CUDAGRAPH_OR_ERROR" in str(err)
    from loom_sidefx import Refusal, RefusalError

    assert isinstance(err, RefusalError) and err.reason is reason
    assert isinstance(reason, Refusal)


# --- held outputs ------------------------------------------------------------------------------


def _recording_with_output(static: torch.Tensor) -> Recording:
    rec = Recording(
        guard=None,  # type: ignore[arg-type]
        probe=None,  # type: ignore[arg-type]
        graph=None,
        replay=lambda: None,
        arg_idx=[],
        bufs=[],
        fill=[],
        out_tree=None,
        outs=[static],
        out_watch=[],
        exit_pairs=[],
        held=[],
        handed=[None],
    )
    count = storage_counter(static)
    rec.out_watch = [(0, (), count, count())]
    rec.tensor_pos = [0]
    return rec


def test_held_output_moves_to_fresh_memory_before_a_replay_overwrites_it() -> None:
    static = torch.arange(3.0)
    rec = _recording_with_output(static)
    held = static.detach()
    rec.handed = [weakref.ref(held)]
    assert protect_outputs(rec)
    static.add_(10)  # the replay
    assert held.tolist() == [0.0, 1.0, 2.0]
    assert held.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()


def test_dropped_output_is_not_copied_and_a_held_view_forbids_the_replay() -> None:
    static = torch.arange(3.0)
    rec = _recording_with_output(static)
    alias = static.detach()
    rec.handed = [weakref.ref(alias)]
    del alias
    assert protect_outputs(rec)
    alias = static.detach()
    view = alias[1:]
    rec.handed = [weakref.ref(alias)]
    assert not protect_outputs(rec)
    del view
    assert protect_outputs(rec)
    assert copy.copy(static).tolist() == [0.0, 1.0, 2.0]


# --- docs ---------------------------------------------------------------------------------------


def test_every_refusal_and_guard_kind_is_documented() -> None:
    from pathlib import Path

    text = (Path(HERE).resolve().parents[3] / "docs" / "capture_step.md").read_text()
    missing = [k.name for k in StepRefusalKind if f"`{k.name}`" not in text]
    missing += [
        k.name for k in (CudagraphRefusalKind.CAPTURE_FAILED, CudagraphRefusalKind.RECORDING_BUDGET)
    ]
    missing = [k for k in missing if f"`{k}`" not in text]
    missing += [k.value for k in GuardKind if f"`{k.value}`" not in text]
    assert not missing, f"docs/capture_step.md lacks {missing}"


# --- the captured path, simulated on the host ---------------------------------------------------


class _StepHost(loom_cudagraph.HostCapturer):
    """The host stand-in, plus a capture that fails (after spoiling the gradients, which
    the step must put back) and warm-ups that synchronize (a warning as CUDA's sync
    debug mode gives)."""

    def __init__(self, model: nn.Module, fail: bool = False, warm_sync: bool = False) -> None:
        super().__init__()
        self.model, self.fail, self.warm_sync = model, fail, warm_sync

    def warm_up(self, fn: Callable[[], Any]) -> Any:
        if self.warm_sync:
            warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)  # what mask.all() issues
        return fn()

    def capture_call(self, fn: Any, pool: Any, keep: Any = ()) -> tuple[Any, list[Any]]:
        if self.fail:
            self.captures += 1
            for p in self.model.parameters():
                p.grad = torch.full_like(p, float("nan"))
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture_call(fn, pool, keep)


def _host_pair(
    make_step: Callable[[nn.Module, torch.optim.Optimizer], Callable[..., Any]] = _make_step,
    fail: bool = False,
    warm_sync: bool = False,
    **options: Any,
) -> tuple[
    Callable[..., Any],
    CapturedStep[Any, Any],
    tuple[nn.Module, torch.optim.Optimizer],
    tuple[nn.Module, torch.optim.Optimizer],
    _StepHost,
]:
    m1, m2 = _mlp(), _mlp()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9)
    capturer = _StepHost(m2, fail, warm_sync)
    step = CapturedStep(make_step(m2, o2), StepOptions(**options), capturer=capturer)
    return make_step(m1, o1), step, (m1, o1), (m2, o2), capturer


def _same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def _check_run(
    eager: Callable[..., Any], step: Callable[..., Any], batches: list[Any]
) -> list[Any]:
    got = []
    for args in batches:
        want = eager(*args)
        got.append((step(*args), want))
    for k, (g, w) in enumerate(got):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, k=k: f"call {k}: {m}")
    return got


def test_host_captured_step_replays_and_matches_eager() -> None:
    eager, step, (m1, _), (m2, _), device = _host_pair()
    _check_run(eager, step, _batches(10))
    _same(m1, m2)
    s = step.stats()
    assert (s.warmup_calls, s.recordings, s.replays, s.uncaptured_calls) == (3, 1, 7, 0), s.format()
    assert device.captures == 1 and s.refusal is None


def test_host_changed_batch_records_again_and_old_recording_still_replays() -> None:
    eager, step, (m1, _), (m2, _), _ = _host_pair()
    sizes = [16] * 5 + [8] * 4 + [16] * 3
    _check_run(eager, step, [_batches(i + 1, b)[-1] for i, b in enumerate(sizes)])
    _same(m1, m2)
    s = step.stats()
    assert s.recordings == 2 and s.replays == len(sizes) - 4, s.format()
    assert "[8, 4]" in s.rerecords[0]


def test_host_float_lr_change_records_again() -> None:
    eager, step, (m1, o1), (m2, o2), _ = _host_pair()
    for i, args in enumerate(_batches(10)):
        if i == 5:
            o1.param_groups[0]["lr"] = o2.param_groups[0]["lr"] = 0.01
        torch.testing.assert_close(step(*args), eager(*args), rtol=0, atol=0)
    _same(m1, m2)
    assert step.stats().recordings == 2
    assert "['lr'] was 0.05 at capture, is 0.01 now" in step.stats().rerecords[0]


def test_host_float_lr_every_call_spends_the_budget_once() -> None:
    eager, step, (m1, o1), (m2, o2), _ = _host_pair(max_recordings=2)
    events: list[loom_step.StepEvent] = []
    step.listener = events.append
    for args in _batches(10):
        torch.testing.assert_close(step(*args), eager(*args), rtol=0, atol=0)
        for o in (o1, o2):
            o.param_groups[0]["lr"] *= 0.9
    _same(m1, m2)
    budget = [e for e in events if e.kind == "budget"]
    assert len(budget) == 1 and "['lr']" in budget[0].message
    assert budget[0].refusal is not None
    assert budget[0].refusal.kind is CudagraphRefusalKind.RECORDING_BUDGET
    assert step.stats().budget_skips == 10 - 3 - 2


def test_host_gradient_accumulation_over_several_calls() -> None:
    def micro(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        def micro_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(model(x), y) / 4
            loss.backward()
            return loss

        return micro_step

    eager, step, (m1, o1), (m2, o2), _ = _host_pair(micro)
    batches = _batches(20)
    for outer in range(5):
        _check_run(eager, step, batches[outer * 4 : outer * 4 + 4])
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        for o in (o1, o2):
            o.step()
            o.zero_grad()
    _same(m1, m2)
    s = step.stats()
    assert s.recordings == 3 and s.replays == 17 and s.refusal is None, s.format()


def test_host_in_place_zeroing() -> None:
    eager, step, (m1, _), (m2, _), _ = _host_pair(lambda m, o: _zero_in_place_step(m, o))
    _check_run(eager, step, _batches(8))
    _same(m1, m2)
    assert step.stats().recordings == 1 and step.stats().replays == 5


def _zero_in_place_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_host_held_losses_stay_correct() -> None:
    eager, step, _, _, _ = _host_pair()
    got = _check_run(eager, step, _batches(10))
    torch.testing.assert_close(torch.stack([g for g, _ in got]), torch.stack([w for _, w in got]))


def test_host_parameter_replaced_between_steps_records_again() -> None:
    eager, step, (m1, o1), (m2, o2), _ = _host_pair()
    for i, args in enumerate(_batches(10)):
        if i == 5:
            for m, o in ((m1, o1), (m2, o2)):
                new = nn.Parameter(m[3].weight.detach() * 0.5)
                m[3].weight = new
                o.param_groups[0]["params"][2] = new
        torch.testing.assert_close(step(*args), eager(*args), rtol=0, atol=0)
    _same(m1, m2)
    s = step.stats()
    assert s.recordings == 2 and "model.3.weight" in s.rerecords[0], s.format()


def test_host_python_state_changed_inside_the_step_is_refused() -> None:
    def decaying(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        inner = _make_step(model, opt)

        def decaying_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.param_groups[0]["lr"] *= 0.9
            return inner(x, y)

        return decaying_step

    eager, step, (m1, _), (m2, _), device = _host_pair(decaying)
    _check_run(eager, step, _batches(6))
    _same(m1, m2)
    reason = step.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.PYTHON_STATE
    assert "['lr']" in reason.explanation and device.captures == 0


def test_host_python_output_is_refused_after_its_call() -> None:
    def returns_float(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        inner = _make_step(model, opt)
        return lambda x, y: (inner(x, y), 1.5)

    eager, step, (m1, _), (m2, _), _ = _host_pair(returns_float)
    _check_run(eager, step, _batches(6))
    _same(m1, m2)
    reason = step.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.HOST_OUTPUT


def test_host_capture_failure_restores_gradients_and_runs_eagerly() -> None:
    eager, step, (m1, _), (m2, _), _ = _host_pair(fail=True)
    _check_run(eager, step, _batches(6))
    _same(m1, m2)
    reason = step.stats().refusal
    assert reason is not None and reason.kind is CudagraphRefusalKind.CAPTURE_FAILED
    assert "operation not permitted" in reason.explanation


def test_host_sync_only_in_warm_up_still_captures() -> None:
    """Libraries skip their data-dependent checks under capture (transformers'
    masks): a warm-up's sync is no refusal when the capture succeeds."""
    eager, step, (m1, _), (m2, _), device = _host_pair(warm_sync=True)
    _check_run(eager, step, _batches(8))
    _same(m1, m2)
    s = step.stats()
    assert s.refusal is None and device.captures == 1 and s.replays == 5, s.format()


def test_host_sync_in_warm_up_names_the_refusal_when_the_capture_fails() -> None:
    eager, step, (m1, _), (m2, _), device = _host_pair(fail=True, warm_sync=True)
    _check_run(eager, step, _batches(6))
    _same(m1, m2)
    reason = step.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP and device.captures == 1
    assert reason.where.startswith(f"{HERE}:") and "warm_up" in reason.where
    assert reason.op.startswith("warnings.warn(SYNC_WARNING")
    _, step, _, _, _ = _host_pair(fail=True, warm_sync=True, or_error=True)
    for args in _batches(3):
        step(*args)
    with pytest.raises(
        loom_step.CaptureStepError, match=r"\[sync_op\] .*in warm_up: warnings.warn"
    ):
        step(*_batches(4)[-1])


def test_host_refusal_raises_under_or_error() -> None:
    _, step, _, _, _ = _host_pair(fail=True, or_error=True)
    for args in _batches(3):
        step(*args)
    with pytest.raises(loom_step.CaptureStepError, match="capture_failed"):
        step(*_batches(4)[-1])


@pytest.mark.parametrize("change", ["moved_data", "frozen", "new_state_tensor", "lr_value"])
def test_host_fast_path_sees_every_change(change: str) -> None:
    eager, step, (m1, o1), (m2, o2), _ = _host_pair()
    for i, args in enumerate(_batches(10)):
        if i == 6:
            for m, o in ((m1, o1), (m2, o2)):
                if change == "moved_data":
                    m[0].bias.data = m[0].bias.data.clone()
                elif change == "frozen":
                    m[0].bias.requires_grad_(False)
                elif change == "new_state_tensor":
                    p = m[0].weight
                    o.state[p]["momentum_buffer"] = o.state[p]["momentum_buffer"].clone()
                else:
                    o.param_groups[0]["momentum"] = 0.5
        torch.testing.assert_close(step(*args), eager(*args), rtol=0, atol=0)
    _same(m1, m2)
    s = step.stats()
    assert s.recordings == 2 and s.replays == 10 - 4, s.format()  # 3 warm-ups, 1 for the change


def test_host_held_views_of_losses_stay_correct_and_switch_to_copies() -> None:
    eager, step, (m1, _), (m2, _), device = _host_pair()
    kept = []
    for args in _batches(10):
        want = eager(*args)
        kept.append((step(*args).detach(), want))  # a second tensor on the output's memory
    for k, (got, want) in enumerate(kept):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, k=k: f"call {k}: {m}")
    _same(m1, m2)
    s = step.stats()
    assert s.recordings == 2 and "view of an output" in s.rerecords[0], s.format()
    assert s.replays == 7 and s.uncaptured_calls == 0 and device.captures == 2


_HELPER_MODEL = nn.Linear(2, 2)
_HELPER_OPT = torch.optim.SGD(_HELPER_MODEL.parameters(), lr=0.1)


def _helper_update() -> None:
    _HELPER_OPT.step()


def test_targets_of_helper_functions_the_step_calls() -> None:
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = _HELPER_MODEL(x).sum()
        loss.backward()
        _helper_update()
        return loss

    targets = find_targets(lambda x: train_step(x))
    assert [n for n, _ in targets.modules] == ["train_step._HELPER_MODEL"]
    assert [n for n, _ in targets.optimizers] == ["train_step._helper_update._HELPER_OPT"]


def test_pointer_check_fallback_agrees_with_torch() -> None:
    from loom_step._torch_compat import _data_ptrs_equal_py, data_ptrs_equal

    a, b = torch.ones(2), torch.zeros(2)
    objs: list[Any] = [a, 3, b]
    ptrs: list[int | None] = [a.data_ptr(), None, b.data_ptr()]
    for check in (data_ptrs_equal, _data_ptrs_equal_py):
        assert check(objs, ptrs, [0, 2])
        assert not check([a, 3, a], ptrs, [0, 2])


# --- memory: what a captured step keeps alive ---------------------------------------------------


class _DryGraph:
    """What a CUDA graph holds on the Python side: nothing (its memory is its pool)."""


class _DryRun(loom_cudagraph.HostCapturer):
    """A capture that runs the step once, as a CUDA capture's dry run allocates its
    memory once, and keeps no reference to anything (a ``torch.cuda.CUDAGraph``
    holds no Python object); a replay does nothing. ``inside`` runs inside each capture."""

    def __init__(self, inside: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.inside = inside
        self.graphs: list[weakref.ref[_DryGraph]] = []

    def capture_call(self, fn: Any, pool: Any, keep: Any = ()) -> tuple[Any, list[Any]]:
        self.inside()
        graph = _DryGraph()
        self.graphs.append(weakref.ref(graph))
        return graph, list(fn())

    def replayer(self, graph: Any) -> Callable[[], object]:
        return _dry_replay


def _dry_replay() -> None:
    return None


def _none_grads_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
    """The benchmark's step: gradients set to None first, a detached loss returned."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _storages(tensors: Any) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for t in tensors if t is not None]


@contextlib.contextmanager
def _no_cycle_collection() -> Any:
    """Only reference counts free memory in the block (a cycle holding a tensor shows)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_host_capture_keeps_nothing_of_the_warm_up_calls() -> None:
    """After the capture, no gradient, output or activation of a warm-up call is alive
    (when the step sets gradients to None), nor an activation of the capture itself:
    what stays is the step's own state (parameters, momentum buffers) and what the
    capture made that replays write (gradients, the static output)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    acts: list[list[StorageWeakRef]] = []
    for sub in model:
        sub.register_forward_hook(lambda m, i, o: acts[-1].extend(_storages([o])))
    device = _DryRun()
    step = CapturedStep(_none_grads_step(model, opt), capturer=device)
    grads: list[list[StorageWeakRef]] = []
    outs: list[list[StorageWeakRef]] = []
    with _no_cycle_collection():
        for x, y in _batches(6):
            acts.append([])
            out = step(x, y)
            outs.append(_storages([out]))
            del out
            grads.append(_storages(p.grad for p in model.parameters()))
        s = step.stats()
        assert (s.warmup_calls, s.recordings, s.replays) == (3, 1, 3), s.format()
        alive = [
            f"{what} of call {i}"
            for what, per_call, calls in (
                ("a gradient", grads, range(3)),
                ("the output", outs, range(3)),
                ("an activation", acts, range(4)),
            )
            for i in calls
            if any(not w.expired() for w in per_call[i])
        ]
        assert alive == [], alive
        params = list(model.parameters())
        assert _storages(p.grad for p in params) == grads[3] == grads[5]
        assert not any(w.expired() for w in grads[3] + outs[3])


def test_host_gradients_found_at_the_capture_are_held_through_it_only() -> None:
    """The gradients the capture finds (the last warm-up's) are held while it runs,
    to be restored if it fails, and released once it is made."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    entry: list[StorageWeakRef] = []
    seen: list[bool] = []
    device = _DryRun(inside=lambda: seen.extend(not w.expired() for w in entry))
    step = CapturedStep(_none_grads_step(model, opt), capturer=device)
    batches = _batches(5)
    with _no_cycle_collection():
        for x, y in batches[:3]:
            step(x, y)
        entry += _storages(p.grad for p in model.parameters())
        step(*batches[3])
        assert seen and all(seen), "the capture ran without the gradients to restore"
        assert all(w.expired() for w in entry)
        step(*batches[4])
        assert step.stats().replays == 2


def test_host_dropped_step_or_refused_recording_frees_its_graph_and_buffers() -> None:
    """No reference cycle keeps a recording (its graph, pool, static buffers) alive:
    dropping the step, or a refusal after the capture, frees them at once."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    device = _DryRun()
    step = CapturedStep(_none_grads_step(model, opt), capturer=device)
    with _no_cycle_collection():
        for x, y in _batches(5):
            step(x, y)
        (rec,) = step._recordings
        held = _storages([*rec.bufs, *rec.outs])
        del rec
        del step
        assert device.graphs[0]() is None and all(w.expired() for w in held)

        inner = _none_grads_step(model, opt)
        refused = CapturedStep(lambda x, y: (inner(x, y), 1.5), capturer=device)
        for x, y in _batches(5):
            refused(x, y)
        reason = refused.stats().refusal
        assert reason is not None and reason.kind is StepRefusalKind.HOST_OUTPUT
        assert device.graphs[1]() is None


def test_warm_ups_after_the_first_take_the_branch_a_capture_takes() -> None:
    """Code that branches on ``torch.cuda.is_current_stream_capturing()`` (transformers'
    attention masks) takes the capture's branch in every warm-up after the first, so
    what that branch compiles is compiled before the capture; the function is put back."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    branches: list[bool] = []
    inner = _make_step(model, opt)
    original = torch.cuda.is_current_stream_capturing

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # NOTE: the real function needs a CUDA driver; here it answers only where replaced
        answer = torch.cuda.is_current_stream_capturing
        branches.append(answer is not original and answer())
        return inner(x, y)

    step = loom_step.capture_step(
        train_step, capturer=loom_cudagraph.HostCapturer(), options=StepOptions(warmup=3)
    )
    for x, y in _batches(3):
        step(x, y)
    assert step.stats().warmup_calls == 3
    assert branches == [False, True, True]
    assert torch.cuda.is_current_stream_capturing is original
