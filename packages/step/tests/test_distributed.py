"""capture_step and DDP or FSDP2, in one process: the ranks' actions are ordered for a
minimum to be the most conservative, a host synchronization inside a library
names that library's frame (DDP's with what capture_step does about it), a DTensor
(FSDP2's parameters, gradients, optimizer state) is guarded by its local tensor, FSDP2
settings a capture cannot hold are refused, and a failed capture names the frame
that raised. The two-rank
agreement is tested in tests_integration/test_capture_step_ranks.py.
"""

from __future__ import annotations

import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loom_cudagraph import CudagraphRefusalKind
from loom_step import GuardKind, StepRefusalKind
from loom_step import _torch_compat as compat
from loom_step._distributed import Action, fsdp2_refusal
from loom_step._guard import StepProbe
from loom_step._refusals import capture_refusal, sync_refusal
from loom_step._targets import find_targets


def test_actions_are_ordered_from_the_most_conservative() -> None:
    order = [Action.REFUSE, Action.EAGER, Action.WARM_UP, Action.CAPTURE, Action.REPLAY]
    assert sorted(order) == order and min(Action.REPLAY, Action.WARM_UP) is Action.WARM_UP


def test_a_sync_inside_ddp_names_ddps_frame_and_what_capture_step_does_about_it() -> None:
    import torch.nn.parallel.distributed as ddp_module

    source = Path(ddp_module.__file__).read_text().splitlines()
    lineno = next(
        i + 1 for i, line in enumerate(source) if "self.logger.set_runtime_stats_and_log()" in line
    )

    def users_step() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()  # the user's line: the model's call

    stack = users_step()
    user_line = stack[-1].lineno
    stack.append(traceback.FrameSummary(ddp_module.__file__, lineno, "_pre_forward"))
    reason = sync_refusal(stack)
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP
    assert reason.where == f"{__file__}:{user_line} in users_step"
    assert reason.origin == (
        f"torch/nn/parallel/distributed.py:{lineno} in _pre_forward: "
        "self.logger.set_runtime_stats_and_log()"
    )
    assert f"(synchronized in {reason.origin})" in str(reason)
    assert "_set_ddp_runtime_logging_sample_rate" in reason.hint


def test_a_sync_on_the_users_own_line_names_no_library_frame() -> None:
    def users_step() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()

    reason = sync_refusal(users_step())
    assert reason is not None and reason.origin == ""
    assert "synchronized in" not in str(reason) and ".item()" in reason.hint


# --- FSDP2: DTensor addresses, refusals, a failed capture's library frame ------------------


@pytest.fixture
def fake_group() -> Iterator[None]:
    """A two-rank process group that runs nothing (this process is rank 0): enough to
    make DTensors as FSDP2 holds them. Destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_guarded_by_its_local_tensors_identity_and_address(
    fake_group: None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    layer = torch.nn.Linear(4, 4, bias=False)
    local = torch.randn(2, 4)
    layer.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    w = layer.weight
    assert w.data_ptr() == 0  # a DTensor has no memory of its own
    assert compat.address(w) == local.data_ptr() != 0
    assert compat.local_tensor(w) is w._local_tensor and compat.local_tensor(local) is None

    def step() -> None:
        layer(torch.ones(1, 4))

    probe = StepProbe(find_targets(step))
    before = probe.read([], None)
    check = probe.fast_check((), [None])
    assert check.matches(())
    w._local_tensor = local.clone()  # new memory behind the same parameter object
    assert not check.matches(())
    mismatch = before.mismatch(probe.read([], None))
    assert mismatch is not None and mismatch.kind is GuardKind.ADDRESSES


class _FakeFSDP2State:
    def __init__(self, offload: bool, event: object = None) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        self._fsdp_param_group = types.SimpleNamespace(offload_policy=policy)
        self._state_ctx = types.SimpleNamespace(post_optim_event=event)


class _FakeFSDP2(torch.nn.Module):
    def __init__(self, state: _FakeFSDP2State) -> None:
        super().__init__()
        self.state = state

    def _get_fsdp_state(self) -> _FakeFSDP2State:
        return self.state


def test_fsdp2_settings_a_capture_cannot_hold_are_refused_naming_the_setting() -> None:
    where = "train.py:3 in step"
    assert fsdp2_refusal([("model", _FakeFSDP2(_FakeFSDP2State(False)))], where) is None
    offload = fsdp2_refusal([("model.layers.0", _FakeFSDP2(_FakeFSDP2State(True)))], where)
    assert offload is not None and offload.kind is StepRefusalKind.DISTRIBUTED
    assert offload.where == where
    assert offload.op == "fully_shard(model.layers.0, offload_policy=CPUOffloadPolicy())"
    event = fsdp2_refusal([("model", _FakeFSDP2(_FakeFSDP2State(False, object())))], where)
    assert event is not None and event.op == "model.set_post_optim_event(event)"
    assert "across the capture's end" in event.explanation


def test_a_failed_capture_names_the_users_line_and_the_library_frame_that_raised() -> None:
    import torch.distributed.distributed_c10d as c10d

    def users_step() -> None:
        c10d._get_default_group()  # raises: no process group

    try:
        users_step()
    except ValueError as exc:
        reason = capture_refusal(users_step, exc, "the hint")
    assert reason.kind is CudagraphRefusalKind.CAPTURE_FAILED
    assert (
        reason.where.endswith("in users_step")
        and reason.op == "c10d._get_default_group()  # raises: no process group"
    )
    assert reason.origin.startswith("torch/distributed/distributed_c10d.py:")
    assert " in _get_default_group: " in reason.origin
    assert f"(raised in {reason.origin})" in str(reason) and reason.hint == "the hint"


def test_a_returned_dtensor_norm_held_across_replays_keeps_its_value(fake_group: None) -> None:
    """An FSDP2 step that clips and returns the total norm (a DTensor, whose memory is
    its local tensor): each norm the caller holds keeps its own value while later
    replays overwrite the recording's output (it crashed in ``protect_outputs``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import loom_cudagraph
    import loom_step

    mesh = init_device_mesh("cpu", (2,))

    def model_and_opt() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 4, bias=False)
        weight = DTensor.from_local(layer.weight.detach()[:2].clone(), mesh, [Shard(0)])
        layer.weight = torch.nn.Parameter(weight)
        return layer, torch.optim.SGD(layer.parameters(), lr=0.1)

    def make_step(layer: torch.nn.Linear, opt: torch.optim.Optimizer) -> Any:
        def train_step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            opt.zero_grad()
            loss = layer(DTensor.from_local(x, mesh, [Replicate()])).pow(2).sum()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.5)
            opt.step()
            return loss, norm

        return train_step

    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    eager = make_step(*model_and_opt())
    want = [tuple(t.to_local().item() for t in eager(x)) for x in inputs]

    layer, opt = model_and_opt()
    step = loom_step.capture_step(
        make_step(layer, opt),
        capturer=loom_cudagraph.HostCapturer(),
        options=loom_step.StepOptions(warmup=1),
    )
    held = [step(x) for x in inputs]
    stats = step.stats()
    assert (stats.recordings, stats.replays) == (1, len(inputs) - 1), stats.format()
    assert all(isinstance(norm, DTensor) for _, norm in held)
    got = [tuple(t.to_local().item() for t in out) for out in held]
    assert [v for pair in got for v in pair] == pytest.approx(
        [v for p in want for v in p], rel=1e-6
    )
    assert len({norm for _, norm in got}) == len(inputs)  # each step's own norm


# --- DDP: the reducer rebuilt so that its grad accumulators record a new stream ------------


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group (DDP runs its reducer and communication hooks on it)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _accumulator(p: torch.Tensor) -> Any:
    return p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("hook", "compiled"), [("python", False), ("builtin", False), ("none", False), ("none", True)]
)
def test_a_rebuilt_ddp_reducer_makes_new_accumulators_and_keeps_hooks_and_settings(
    gloo_group: None, hook: str, compiled: bool
) -> None:
    """The rebuild frees the nodes the old reducer kept, also where ``torch.compile``
    wrapped the DDP (its wrappers hold copies of DDP's ``__dict__``, reducer included)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> DDP:
        torch.manual_seed(0)
        return DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))

    calls: list[int] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(1)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp, ref = model(), model()
    for m in (ddp, ref):
        if hook == "python":
            m.register_comm_hook(None, counting_hook)
        elif hook == "builtin":
            m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    ddp._set_static_graph()
    wrapped = [torch.compile(ddp, backend="aot_eager")] if compiled else []
    for p in ddp.parameters():
        _accumulator(p).metadata["built_with_ddp"] = True  # the node the reducer keeps
    assert all("built_with_ddp" in _accumulator(p).metadata for p in ddp.parameters())

    compat.rebuild_ddp_reducer(ddp, wrapped)

    assert not any("built_with_ddp" in _accumulator(p).metadata for p in ddp.parameters())
    assert ddp.static_graph and ddp._get_ddp_logging_data().get("static_graph") == 1
    if hook != "none":
        want = "counting_hook" if hook == "python" else "ALLREDUCE"
        assert want in str(ddp._get_ddp_logging_data().get("comm_hook"))
    x = torch.randn(5, 4)
    for m in (ddp, ref):
        for _ in range(2):
            m(x).pow(2).sum().backward()
    for p, q in zip(ddp.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    assert len(calls) == (4 if hook == "python" else 0)  # 2 models x 2 backwards, 1 bucket


def test_sgd_with_a_tensor_lr_is_refused_with_what_to_change() -> None:
    """torch's SGD reads a tensor lr on the host (``alpha=-lr``): the refusal names
    SGD's frame and tells the user to use a float lr or a capturable optimizer."""
    import torch.optim.sgd as sgd_module

    def users_step() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()

    stack = users_step()
    source = Path(sgd_module.__file__).read_text().splitlines()
    lineno = next(i + 1 for i, line in enumerate(source) if "alpha=-lr)" in line)
    stack.append(traceback.FrameSummary(sgd_module.__file__, lineno, "_multi_tensor_sgd"))
    reason = sync_refusal(stack)
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP
    assert reason.origin.startswith("torch/optim/sgd.py:")
    assert "float lr with SGD" in reason.hint and "capturable=True" in reason.hint


def test_fsdp2_events_of_a_failed_capture_are_forgotten_before_the_eager_call(
    fake_group: None,
) -> None:
    """After a failed capture FSDP2 holds events recorded inside it (the last
    all-gather's, the post-reduce event), which the eager call that follows would wait on
    (CUDA: "invalid argument"). They are dropped, and an eager step runs after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 4)).sum().backward()
    states = [compat._fsdp2_state(m) for m in model]  # the root holds no parameters
    stale = object()  # stands for an event recorded inside the failed capture
    for state in states:
        state._comm_ctx.all_gather_state = stale
        state._fsdp_param_group._post_reduce_event = stale
    for m in (*model, model):
        compat.fsdp2_forget_events(m)
    assert all(s._comm_ctx.all_gather_state is None for s in states)
    assert all(s._fsdp_param_group._post_reduce_event is None for s in states)
    model(torch.randn(2, 4)).sum().backward()  # the eager call after the failed capture
