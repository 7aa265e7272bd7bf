"""capture_step's per-call check (``FastCheck``): each thing the full guard reads, changed
between calls, makes the check fail (so the call goes through the full guard and never
replays a stale graph), and an unchanged call passes it (so replays stay cheap)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import loom_cudagraph
from loom_step import CapturedStep
from loom_step import _torch_compat as compat
from loom_step._fast import NEVER, FastCheck
from loom_step._guard import StepProbe
from loom_step._targets import find_targets
from loom_step._torch_compat import tree_flatten


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


class _Setup:
    def __init__(self) -> None:
        self.model = _Net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.shift = torch.zeros(1)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        model, opt, scaler = self.model, self.opt, self.scaler

        def train_step(x: torch.Tensor, y: torch.Tensor, k: int = 1) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = nn.functional.mse_loss(model(x) + self.shift * k, y)
            loss.backward()
            scaler.is_enabled()
            opt.step()
            return loss

        self.fn = train_step
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        train_step(self.x, self.y)  # gradients and optimizer state exist
        self.probe = StepProbe(find_targets(train_step, [self.shift]))
        self.grads = [p.grad for p in self.probe.params]

    def check(self, *args: Any) -> FastCheck:
        return self.probe.fast_check(args or (self.x, self.y), self.grads)

    def full_guard_changed(self, before: Any, *args: Any) -> bool:
        leaves, tree = tree_flatten((args or (self.x, self.y), {}))
        return before.mismatch(self.probe.read(leaves, tree)) is not None

    def full_guard(self, *args: Any) -> Any:
        leaves, tree = tree_flatten((args or (self.x, self.y), {}))
        return self.probe.read(leaves, tree)


def _params(s: _Setup) -> list[nn.Parameter]:
    return list(s.model.parameters())


#: name -> a change made between two calls (on state the guard reads)
CHANGES: dict[str, Callable[[_Setup], None]] = {
    "parameter replaced": lambda s: setattr(
        s.model.body[0], "weight", nn.Parameter(s.model.body[0].weight.detach().clone())
    ),
    "submodule replaced": lambda s: s.model.body.__setitem__(1, nn.GELU()),
    "buffer registered": lambda s: s.model.body[1].register_buffer("extra", torch.ones(1)),
    "buffer moved": lambda s: setattr(s.model.scale, "data", s.model.scale.data.clone()),
    "parameter moved": lambda s: setattr(
        s.model.body[0].bias, "data", s.model.body[0].bias.data.clone()
    ),
    "parameter frozen": lambda s: s.model.body[0].bias.requires_grad_(False),
    "buffer requires grad": lambda s: s.model.scale.requires_grad_(True),
    "float hyperparameter": lambda s: s.opt.param_groups[0].__setitem__("momentum", 0.5),
    "param_groups rebound": lambda s: setattr(s.opt, "param_groups", list(s.opt.param_groups)),
    "param group added": lambda s: s.opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]}),
    "state tensor replaced": lambda s: s.opt.state[_params(s)[0]].__setitem__(
        "momentum_buffer", s.opt.state[_params(s)[0]]["momentum_buffer"].clone()
    ),
    "state tensor moved": lambda s: setattr(
        s.opt.state[_params(s)[0]]["momentum_buffer"],
        "data",
        s.opt.state[_params(s)[0]]["momentum_buffer"].data.clone(),
    ),
    "state dict replaced": lambda s: s.opt.state.__setitem__(
        _params(s)[1], dict(s.opt.state[_params(s)[1]])
    ),
    "state re-keyed": lambda s: _swap_state(s.opt, _params(s)[0], _params(s)[1]),
    "gradient set to None": lambda s: setattr(_params(s)[2], "grad", None),
    "gradient replaced": lambda s: setattr(_params(s)[2], "grad", torch.zeros_like(_params(s)[2])),
    "gradient moved": lambda s: setattr(
        _params(s)[2].grad,
        "data",
        _params(s)[2].grad.data.clone(),  # type: ignore[union-attr]
    ),
    "tracked tensor moved": lambda s: setattr(s.shift, "data", s.shift.data.clone()),
    "tracked tensor requires grad": lambda s: s.shift.requires_grad_(True),
}


def _swap_state(opt: torch.optim.Optimizer, p: Any, q: Any) -> None:
    """Give ``p`` the state of ``q`` and back, keeping the order of the state dicts."""
    items = list(opt.state.items())
    opt.state.clear()
    for k, v in items:
        opt.state[q if k is p else p if k is q else k] = v


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_fails_the_fast_check_and_the_full_guard(change: str) -> None:
    s = _Setup()
    before = s.full_guard()
    check = s.check()
    assert check.matches((s.x, s.y))  # unchanged: the fast path replays
    CHANGES[change](s)
    assert not check.matches((s.x, s.y)), change
    assert s.full_guard_changed(before), change  # and the full guard agrees: a new recording


@pytest.mark.parametrize(
    "args",
    [
        lambda x, y: (x[:8], y[:8]),
        lambda x, y: (x.double(), y),
        lambda x, y: (x.requires_grad_(), y),
        lambda x, y: (x.to("meta"), y),
        lambda x, y: (x, y, 1),
        lambda x, y: (x,),
        lambda x, y: (x, nn.Parameter(y)),
    ],
    ids=["shape", "dtype", "requires_grad", "device", "extra", "missing", "class"],
)
def test_argument_changes_fail_the_fast_check(args: Callable[..., tuple[Any, ...]]) -> None:
    s = _Setup()
    check = s.check()
    assert check.matches((s.x.clone(), s.y.clone()))  # other tensors, same spec
    assert not check.matches(args(s.x.clone(), s.y.clone()))


def test_non_tensor_arguments_are_compared_by_type_and_value() -> None:
    s = _Setup()
    check = s.check(s.x, s.y, 2)
    assert check.matches((s.x, s.y, 2))
    assert not check.matches((s.x, s.y, 3))
    assert not check.matches((s.x, s.y, 2.0))
    assert not check.matches((s.x, s.y.double(), 2))


def test_modes_fail_the_fast_check() -> None:
    s = _Setup()
    check = s.check()
    with torch.no_grad():
        assert not check.matches((s.x, s.y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not check.matches((s.x, s.y))
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        assert not check.matches((s.x, s.y))
    finally:
        torch.set_autocast_dtype("cpu", before)
    torch.set_autocast_cache_enabled(False)
    try:
        assert not check.matches((s.x, s.y))
    finally:
        torch.set_autocast_cache_enabled(True)
    assert check.matches((s.x, s.y))


def test_tensors_inside_tuple_hyperparameters_and_mutable_values_are_checked() -> None:
    s = _Setup()
    group = s.opt.param_groups[0]
    group["pair"] = (torch.ones(1), torch.ones(1))
    group["schedule"] = [1, 2]
    before = s.full_guard()
    check = s.check()
    assert check.matches((s.x, s.y))
    group["schedule"].append(3)  # same list, new value
    assert not check.matches((s.x, s.y)) and s.full_guard_changed(before)
    group["schedule"].pop()
    assert check.matches((s.x, s.y)) and not s.full_guard_changed(before)
    group["pair"][0].data = torch.zeros(1)  # same tuple and tensor, new address
    assert not check.matches((s.x, s.y)) and s.full_guard_changed(before)


def test_an_enabled_scaler_fails_the_fast_check() -> None:
    s = _Setup()
    check = s.check()
    s.scaler._enabled = True
    assert not check.matches((s.x, s.y))


def test_rebound_closure_object_fails_the_fast_check() -> None:
    scale = torch.ones(3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    probe = StepProbe(find_targets(fn))
    x = torch.ones(3)
    check = probe.fast_check((x,), [])
    assert check.matches((x,))
    scale = torch.full((3,), 2.0)  # rebinds the closure cell
    assert not check.matches((x,))


def test_a_gradient_no_call_presents_never_matches() -> None:
    s = _Setup()
    check = s.probe.fast_check((s.x, s.y), [NEVER, *s.grads[1:]])
    assert not check.matches((s.x, s.y))


def test_nothing_tracked_checks_arguments_and_modes_only() -> None:
    probe = StepProbe(find_targets(lambda x: x * 2 + 1))
    x = torch.ones(4)
    check = probe.fast_check((x,), [])
    assert not check.tracked and check.matches((torch.zeros(4),))
    assert not check.matches((torch.zeros(5),))
    with torch.no_grad():
        assert not check.matches((x,))


def test_compat_checks_agree_with_their_meaning() -> None:
    x = torch.randn(2, 3)
    check = compat.tensors_check([x])
    if check is not None:  # Dynamo's TensorGuards (torch 2.11); else a Python check is used
        assert check(torch.zeros(2, 3)) and not check(torch.zeros(3, 2))
        assert not check(torch.zeros(2, 3, dtype=torch.float64))
        assert not check(torch.zeros(2, 3, requires_grad=True))
    state = compat.global_state_check(torch.is_grad_enabled)
    assert state()
    with torch.no_grad():
        assert not state()
    count = compat.storage_counter(x)
    base = count()
    alias = x.detach()
    assert count() == base + 1
    del alias
    assert count() == base


# --- end to end, on the host stand-in of a CUDA graph -----------------------------------------


class _Noop(loom_cudagraph.HostCapturer):
    """A capture that runs the step once; a replay that does nothing."""

    def capture_call(self, fn: Any, pool: Any, keep: Any = ()) -> tuple[Any, list[Any]]:
        return None, list(fn())

    def replayer(self, graph: Any) -> Callable[[], object]:
        return lambda: None


def test_replays_take_the_fast_path_until_something_changes() -> None:
    s = _Setup()
    step = CapturedStep(s.fn, capturer=_Noop())
    for _ in range(4):  # 3 warm-ups and the capture
        step(s.x, s.y)
    slow = step.counts.slow_calls
    for _ in range(5):
        step(s.x, s.y)
    assert step.counts.slow_calls == slow and step.stats().replays == 6
    s.opt.param_groups[0]["momentum"] = 0.5
    step(s.x, s.y)  # the full guard: a new guard set (one eager call)
    assert step.counts.slow_calls == slow + 1 and step.stats().replays == 6
    step(s.x, s.y)  # its capture
    assert step.stats().recordings == 2
    step(s.x, s.y)
    assert step.counts.slow_calls == slow + 2 and step.stats().replays == 8


def test_replays_after_a_full_check_refresh_the_fast_check() -> None:
    s = _Setup()
    step = CapturedStep(s.fn, capturer=_Noop())
    for _ in range(5):
        step(s.x, s.y)
    x = s.x.t().contiguous().t()  # other strides: the fast check may miss, the guard holds
    step(x, s.y)
    slow = step.counts.slow_calls
    step(x, s.y)
    step(x, s.y)
    assert step.counts.slow_calls == slow and step.stats().recordings == 1


def test_requires_grad_is_guarded_for_what_autograd_records_only() -> None:
    """An optimizer's state is updated under no_grad: its requires_grad changes no step."""
    s = _Setup()
    before = s.full_guard()
    check = s.check()
    s.opt.state[_params(s)[0]]["momentum_buffer"].requires_grad_(True)
    assert check.matches((s.x, s.y)) and not s.full_guard_changed(before)


def test_keyword_arguments_take_the_fast_path_in_the_same_order() -> None:
    s = _Setup()
    step = CapturedStep(s.fn, capturer=_Noop())
    for _ in range(5):
        step(x=s.x, y=s.y)
    slow = step.counts.slow_calls
    step(x=s.x.clone(), y=s.y.clone())
    step(s.x, y=s.y.clone())  # the same leaves, another structure: the full guard
    assert step.counts.slow_calls == slow + 1
    slow = step.counts.slow_calls
    step(y=s.y, x=s.x)  # another key order is another structure
    assert step.counts.slow_calls == slow + 1
    step(x=s.x[:8], y=s.y[:8])
    assert step.counts.slow_calls == slow + 2
    assert step.stats().refusal is None


def test_arguments_in_containers_go_through_the_full_guard_and_still_replay() -> None:
    s = _Setup()

    def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return s.fn(*batch)

    step = CapturedStep(fn, capturer=_Noop())
    for _ in range(6):
        step((s.x, s.y))
    assert step.stats().replays == 3 and step.stats().recordings == 1


def test_without_dynamos_cpp_checks_the_python_ones_catch_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "_TENSOR_GUARDS", None)
    monkeypatch.setattr(compat, "_GLOBAL_STATE_GUARD", None)
    assert compat.tensors_check([torch.ones(1)]) is None
    s = _Setup()
    check = s.check()
    assert check.matches((s.x.clone(), s.y.clone()))
    assert not check.matches((s.x[:8], s.y[:8]))
    assert not check.matches((s.x.double(), s.y))
    with torch.no_grad():
        assert not check.matches((s.x, s.y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not check.matches((s.x, s.y))
    torch.set_autocast_cache_enabled(False)
    try:
        assert not check.matches((s.x, s.y))
    finally:
        torch.set_autocast_cache_enabled(True)


def test_micro_steps_of_an_accumulation_switch_recordings_without_the_full_guard() -> None:
    s = _Setup()
    model = s.model

    def micro_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y) / 2
        loss.backward()
        return loss

    step = CapturedStep(micro_step, capturer=_Noop())
    slow_after: list[int] = []
    for _ in range(6):
        step(s.x, s.y)  # gradients None: the first micro-step's recording
        step(s.x, s.y)  # gradients exist: the accumulating recording
        s.opt.zero_grad()
        slow_after.append(step.counts.slow_calls)
    stats = step.stats()
    assert stats.recordings == 3 and stats.refusal is None, stats.format()  # as on CUDA
    # Once both recordings exist, every call finds its recording through a per-call check.
    assert slow_after[-1] == slow_after[-3], slow_after
