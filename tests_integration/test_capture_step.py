"""torchloom.capture_step on a CUDA device: each behaviour against eager over
several steps (changed batch, changed lr, accumulation, held losses, dropout,
a replaced parameter, refused ops, bf16 autocast, a loom-compiled model).

Run through scripts/gpu_tier.sh (marker ``gpu``)::

    GPU_TIER=tests GPU_TESTS_K="capture_step" bash scripts/gpu_tier.sh
"""

from __future__ import annotations

import copy
import gc
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchloom
from torchloom import StepRefusalKind

pytestmark = pytest.mark.gpu

HERE = __file__
TOL = {"rtol": 1e-5, "atol": 1e-6}

Step = Callable[..., Any]
MakeOpt = Callable[[Any], torch.optim.Optimizer]


@pytest.fixture
def cuda(cuda_without_tf32: torch.device) -> Iterator[torch.device]:
    torch.manual_seed(0)
    yield cuda_without_tf32


def _mlp(device: torch.device, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 1),
    ).to(device)


def _batch(i: int, device: torch.device, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(batch, 32, generator=g), torch.randn(batch, 1, generator=g)
    return x.to(device), y.to(device)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, capturable=True)


def _standard_step(model: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool = True) -> Step:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def _pair(
    device: torch.device, make_opt: MakeOpt = _adamw, dropout: float = 0.0
) -> tuple[tuple[nn.Module, torch.optim.Optimizer], tuple[nn.Module, torch.optim.Optimizer]]:
    base = _mlp(device, dropout)
    eager, loom = copy.deepcopy(base), copy.deepcopy(base)
    return (eager, make_opt(eager.parameters())), (loom, make_opt(loom.parameters()))


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _run(
    eager: Step, captured: Step, batches: list[tuple[torch.Tensor, ...]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    want, got = [], []
    for args in batches:
        want.append(eager(*args))
        got.append(captured(*args))
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, k=k: f"step {k}: {m}")
    return want, got


# --- plain steps ------------------------------------------------------------------------------


@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd_momentum", "adamw_capturable"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
def test_mlp_step_matches_eager(cuda: torch.device, make_opt: MakeOpt, set_to_none: bool) -> None:
    (m1, o1), (m2, o2) = _pair(cuda, make_opt)
    step = torchloom.capture_step(_standard_step(m2, o2, set_to_none))
    _run(_standard_step(m1, o1, set_to_none), step, [_batch(i, cuda) for i in range(10)])
    _assert_same_params(m1, m2)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
    stats = step.stats()
    assert stats.refusal is None, stats.format()
    assert (stats.warmup_calls, stats.recordings, stats.replays) == (3, 1, 7), stats.format()
    assert [e.kind for e in torchloom.report().entries("capture_step")] == ["recorded"]


def test_empty_cache_between_replays_keeps_the_step_right(cuda: torch.device) -> None:
    """Users call torch.cuda.empty_cache() between steps: nothing a replay reads
    may be memory the allocator counts as free."""
    (m1, o1), (m2, o2) = _pair(cuda, _adamw)
    step = torchloom.capture_step(_standard_step(m2, o2))
    eager = _standard_step(m1, o1)
    for i in range(8):
        torch.cuda.empty_cache()
        junk = [torch.full((1 << 20,), 7.0, device=cuda) for _ in range(4)]
        x, y = _batch(i, cuda)
        torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
        del junk
    torch.cuda.synchronize()
    _assert_same_params(m1, m2)
    assert step.stats().replays == 5, step.stats().format()


def test_empty_cache_between_steps_of_a_loom_cudagraph_model(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda, _adamw)
    compiled = torch.compile(m2, backend="loom", options={"cudagraphs": True})
    for i in range(6):
        torch.cuda.empty_cache()
        x, y = _batch(i, cuda)
        for model, opt in ((m1, o1), (compiled, o2)):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    torch.cuda.synchronize()
    _assert_same_params(m1, m2)


def _wide_step(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)

    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, train_step


def _kept(
    build: Callable[[torch.device], Callable[[], Any]], device: torch.device
) -> tuple[int, int]:
    """(allocated, reserved) bytes a variant keeps after 6 calls, over what was there
    before it was built (unused cached blocks released both times)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    run = build(device)
    for _ in range(6):
        run()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    kept = (
        torch.cuda.memory_allocated(device) - allocated,
        torch.cuda.memory_reserved(device) - reserved,
    )
    del run
    return kept


def _raw_capture(device: torch.device) -> Callable[[], Any]:
    """PyTorch's whole-network recipe, model and optimizer kept alive with the graph
    (it reads their parameters and updates their state at fixed addresses)."""
    model, opt, step = _wide_step(device)
    x = torch.randn(64, 1024, device=device)
    static = x.clone()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)
    keep = (model, opt)

    def run() -> torch.Tensor:
        assert keep
        static.copy_(x)
        graph.replay()
        return out

    return run


def _captured(device: torch.device) -> Callable[[], Any]:
    model, _, step = _wide_step(device)
    x = torch.randn(64, 1024, device=device)
    captured = torchloom.capture_step(step, track=[model])
    return lambda: captured(x)


def test_memory_kept_is_a_raw_captures(cuda: torch.device) -> None:
    """A captured step keeps what a raw capture of the same step keeps (model,
    optimizer state, one pool with the gradients, a static input): nothing of its
    warm-up calls. Reserved memory may differ by segment rounding (20 MiB blocks)."""
    raw = _kept(_raw_capture, cuda)
    step = _kept(_captured, cuda)
    mib = 2**20
    assert step[0] <= raw[0] + mib, (
        f"allocated: capture_step {step[0] / mib:.1f} MiB, raw {raw[0] / mib:.1f} MiB"
    )
    assert step[1] <= raw[1] + 2 * 20 * mib, (
        f"reserved: capture_step {step[1] / mib:.1f} MiB, raw {raw[1] / mib:.1f} MiB"
    )


def test_changed_batch_size_records_again(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    step = torchloom.capture_step(_standard_step(m2, o2))
    sizes = [16] * 5 + [8] * 4 + [16] * 3 + [8] * 2
    _run(_standard_step(m1, o1), step, [_batch(i, cuda, b) for i, b in enumerate(sizes)])
    _assert_same_params(m1, m2)
    stats = step.stats()
    assert stats.recordings == 2 and stats.refusal is None, stats.format()
    assert "arguments" in stats.rerecords[0] and "[8, 32]" in stats.rerecords[0]
    # 3 warm-ups, a capture, one eager call for the new shape, a capture; the rest replay.
    assert stats.replays == len(sizes) - 4


def test_tensor_lr_from_a_scheduler_is_read_by_replays(cuda: torch.device) -> None:
    def make_opt(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=torch.tensor(1e-2, device=cuda), capturable=True)

    (m1, o1), (m2, o2) = _pair(cuda, make_opt)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.5)
    eager, step = _standard_step(m1, o1), torchloom.capture_step(_standard_step(m2, o2))
    for i in range(10):
        x, y = _batch(i, cuda)
        torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
        s1.step()
        s2.step()
    _assert_same_params(m1, m2)
    # the capture's own call replays too: every call after the three warm-ups
    assert step.stats().recordings == 1 and step.stats().replays == 7
    # the graph pool: the step's intermediates, gradients and static outputs
    assert step.stats().pool_bytes > 0 and "graph pool" in step.stats().format()


def test_float_lr_change_records_again(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    eager, step = _standard_step(m1, o1), torchloom.capture_step(_standard_step(m2, o2))
    for i in range(12):
        if i == 6:
            for opt in (o1, o2):
                opt.param_groups[0]["lr"] = 1e-3
        x, y = _batch(i, cuda)
        torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
    _assert_same_params(m1, m2)
    stats = step.stats()
    assert stats.recordings == 2, stats.format()
    assert "['lr'] was 0.01 at capture, is 0.001 now" in stats.rerecords[0]


def test_float_lr_scheduled_every_step_spends_the_budget_with_one_reason(
    cuda: torch.device, caplog: pytest.LogCaptureFixture
) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    s1 = torch.optim.lr_scheduler.ExponentialLR(o1, gamma=0.9)
    s2 = torch.optim.lr_scheduler.ExponentialLR(o2, gamma=0.9)
    eager = _standard_step(m1, o1)
    step = torchloom.capture_step(_standard_step(m2, o2), capture_step_max_recordings=2)
    for i in range(12):
        x, y = _batch(i, cuda)
        torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
        s1.step()
        s2.step()
    _assert_same_params(m1, m2)
    budget = [e for e in torchloom.report().entries("capture_step") if e.kind == "budget"]
    assert len(budget) == 1 and "tensor lr" in budget[0].message
    assert "['lr']" in budget[0].message


# --- gradients --------------------------------------------------------------------------------


def test_gradient_accumulation_over_several_calls(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)

    def micro(model: nn.Module) -> Step:
        def micro_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y) / 4
            loss.backward()
            return loss

        return micro_step

    eager, step = micro(m1), torchloom.capture_step(micro(m2))
    for outer in range(5):
        for k in range(4):
            x, y = _batch(outer * 4 + k, cuda)
            torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
        for opt in (o1, o2):
            opt.step()
            opt.zero_grad()
    _assert_same_params(m1, m2)
    stats = step.stats()
    assert stats.refusal is None and stats.replays >= 10, stats.format()


def test_held_losses_stay_correct_across_replays(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    want, got = _run(
        _standard_step(m1, o1),
        torchloom.capture_step(_standard_step(m2, o2)),
        [_batch(i, cuda) for i in range(10)],
    )
    # Every loss is still held: each one must still be its own step's value.
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    assert len({t.data_ptr() for t in got}) == len(got)


def test_held_views_of_losses_stay_correct(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    eager, step = _standard_step(m1, o1), torchloom.capture_step(_standard_step(m2, o2))
    kept = []
    for i in range(10):
        x, y = _batch(i, cuda)
        want = eager(x, y)
        kept.append((step(x, y).detach(), want))  # losses.append(loss.detach())
    for got, want in kept:
        torch.testing.assert_close(got, want, **TOL)
    _assert_same_params(m1, m2)
    stats = step.stats()
    # The first held view pins the recording's output: one more recording, copying outputs.
    assert stats.recordings == 2 and "view of an output" in stats.rerecords[0], stats.format()
    assert stats.replays == 7 and stats.uncaptured_calls == 0


# --- RNG --------------------------------------------------------------------------------------


def test_dropout_draws_fresh_masks_on_every_replay(cuda: torch.device) -> None:
    model = _mlp(cuda, dropout=0.5)
    opt = _adamw(model.parameters())

    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mask = F.dropout(torch.ones(4096, device=x.device), 0.5, training=True) == 0
        return loss, mask

    torch.manual_seed(1)
    eager_masks = [train_step(*_batch(i, cuda))[1].clone() for i in range(3)]
    step = torchloom.capture_step(train_step)
    masks = [step(*_batch(i, cuda))[1].clone() for i in range(10)]
    assert step.stats().replays == 7
    replayed = masks[3:]
    for a, b in itertools.pairwise(replayed):
        assert not torch.equal(a, b), "two replays drew the same dropout mask"
    for m in (*replayed, *eager_masks):
        assert 0.45 < m.float().mean().item() < 0.55
    # The captured step's distribution matches eager's: the dropped fraction over many draws.
    eager_rate = torch.stack(eager_masks).float().mean().item()
    captured_rate = torch.stack(replayed).float().mean().item()
    assert abs(eager_rate - captured_rate) < 0.03


# --- guards -----------------------------------------------------------------------------------


def test_parameter_replaced_between_steps_records_again(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda, _sgd)
    eager, step = _standard_step(m1, o1), torchloom.capture_step(_standard_step(m2, o2))
    for i in range(12):
        if i == 6:
            for m, o in ((m1, o1), (m2, o2)):
                new = nn.Parameter(m[5].weight.detach() * 0.5)
                m[5].weight = new
                o.param_groups[0]["params"][4] = new
        x, y = _batch(i, cuda)
        torch.testing.assert_close(step(x, y), eager(x, y), **TOL)
    _assert_same_params(m1, m2)
    stats = step.stats()
    assert stats.recordings == 2 and "objects" in stats.rerecords[0], stats.format()


# --- refusals ---------------------------------------------------------------------------------


def _item_step(model: nn.Module, opt: torch.optim.Optimizer, log: list[float]) -> Step:
    def logging_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log.append(loss.item())
        return loss

    return logging_step


def test_item_in_the_step_is_refused_with_the_users_line(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)
    l1: list[float] = []
    l2: list[float] = []
    step = torchloom.capture_step(_item_step(m2, o2, l2))
    _run(_item_step(m1, o1, l1), step, [_batch(i, cuda) for i in range(6)])
    assert l1 == pytest.approx(l2)
    _assert_same_params(m1, m2)
    reason = step.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP
    lines, first = inspect.getsourcelines(_item_step)
    line = first + next(k for k, s in enumerate(lines) if "loss.item()" in s)
    assert reason.where == f"{HERE}:{line} in logging_step"
    assert "loss.item()" in reason.op
    # seen in the warm-ups; the capture is still tried (code may skip a sync under
    # capture), fails on the sync, and the refusal names the warm-up's
    assert step.stats().warmup_calls == 3 and step.stats().replays == 0


def test_item_raises_under_or_error(cuda: torch.device) -> None:
    (_, _), (m2, o2) = _pair(cuda)
    step = torchloom.capture_step(_item_step(m2, o2, []), cudagraph_or_error=True)
    for i in range(3):  # the warm-ups
        step(*_batch(i, cuda))
    with pytest.raises(torchloom.CaptureStepError, match=r"\[sync_op\] .*loss\.item\(\)"):
        step(*_batch(3, cuda))


def test_non_capturable_adamw_is_refused_naming_the_fix(cuda: torch.device) -> None:
    def make_opt(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    (m1, o1), (m2, o2) = _pair(cuda, make_opt)
    step = torchloom.capture_step(_standard_step(m2, o2))
    _run(_standard_step(m1, o1), step, [_batch(i, cuda) for i in range(5)])
    reason = step.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.OPTIMIZER_NOT_CAPTURABLE
    assert "capturable=True" in reason.hint and f"{HERE}:" in reason.where


# --- autocast and compiled models ----------------------------------------------------------------


def test_bf16_autocast_inside_the_step(cuda: torch.device) -> None:
    (m1, o1), (m2, o2) = _pair(cuda)

    def amp(model: nn.Module, opt: torch.optim.Optimizer) -> Step:
        def amp_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            return loss

        return amp_step

    step = torchloom.capture_step(amp(m2, o2))
    _run(amp(m1, o1), step, [_batch(i, cuda) for i in range(8)])
    _assert_same_params(m1, m2)
    assert step.stats().replays == 5


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["loom", "loom_per_graph_cudagraphs"])
def test_model_compiled_with_loom(cuda: torch.device, cudagraphs: bool) -> None:
    # The reference is the same loom-compiled model run uncaptured: the same kernels.
    (m1, o1), (m2, o2) = _pair(cuda)
    options = {"cudagraphs": cudagraphs}
    c1 = torch.compile(m1, backend="loom", options=options)
    c2 = torch.compile(m2, backend="loom", options=options)
    step = torchloom.capture_step(_standard_step(c2, o2))  # type: ignore[arg-type]
    _run(_standard_step(c1, o1), step, [_batch(i, cuda) for i in range(8)])  # type: ignore[arg-type]
    _assert_same_params(m1, m2)
    stats = step.stats()
    assert stats.refusal is None and stats.replays == 5, stats.format()
