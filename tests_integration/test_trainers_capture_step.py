"""``torchloom.trainers``: each trainer's training step through ``capture_step`` in one
line, on the host (``loom_cudagraph.HostCapturer`` stands in for CUDA graphs: a capture
runs the step and undoes its writes, a replay runs it again).

A captured fit must equal the same fit without the callback or mixin: every step's loss,
the trained parameters, Lightning's logged metrics (per step and the epoch's mean) and
its progress counters (``global_step``). A step that cannot be captured is refused with
its kind and hint (``torchloom.StepRefusalKind``), and the fit goes on uncaptured with
the same results. The GPU figures are ``benchmarks/bench_trainers.py``'s.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from real_models import VOCAB, build_gpt2
from torch import nn

import loom_cudagraph
import torchloom
import torchloom.trainers
from torchloom import StepRefusalKind, StepState

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

HERE = __file__
STEPS = 8


# --- PyTorch Lightning --------------------------------------------------------------------


def _lightning_module(log_value: Callable[[torch.Tensor], Any] = lambda loss: loss) -> Any:
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", log_value(loss), on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Regression()


def _lightning_fit(module: Any, *callbacks: Any, **trainer_kwargs: Any) -> dict[str, Any]:
    import pytorch_lightning as pl

    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: Any, m: Any, outputs: Any, *_: Any) -> None:
            losses.append(float(outputs["loss"]))

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(64)]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        default_root_dir=tempfile.mkdtemp(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Losses(), *callbacks],
        **trainer_kwargs,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in module.parameters()],
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "progress": loop.optim_progress.state_dict(),
    }


def _assert_same_fit(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"] and len(got["losses"]) >= STEPS
    for p, q in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for key in ("metrics", "global_step", "progress"):
        assert got[key] == want[key], key


def _captured(**options: Any) -> Any:
    return torchloom.trainers.lightning_capture_step(
        capturer=loom_cudagraph.HostCapturer(), **options
    )


def test_lightning_fit_with_the_callback_captures_and_matches_the_plain_fit() -> None:
    want = _lightning_fit(_lightning_module())
    callback = _captured()
    got = _lightning_fit(_lightning_module(), callback)
    _assert_same_fit(got, want)
    stats = callback.stats()
    assert stats.refusal is None, stats.format()
    # 3 warm-ups, then one recording replayed (its capture's own call counts as one)
    assert (stats.warmup_calls, stats.recordings, stats.replays) == (3, 1, STEPS - 3)
    assert "train_loss_epoch" in got["metrics"] and got["global_step"] == STEPS
    assert [e.kind for e in torchloom.report().entries("capture_step")] == ["recorded"]


def test_lightning_gradient_accumulation_is_refused_and_the_fit_goes_on() -> None:
    want = _lightning_fit(_lightning_module(), accumulate_grad_batches=2)
    callback = _captured()
    got = _lightning_fit(_lightning_module(), callback, accumulate_grad_batches=2)
    _assert_same_fit(got, want)
    reason = callback.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.PYTHON_STATE, reason
    assert reason.op == "accumulate_grad_batches" and "accumulate_grad_batches=1" in reason.hint


def test_lightning_in_step_hook_is_refused_naming_it_and_the_fit_goes_on() -> None:
    import pytorch_lightning as pl

    seen: list[int] = []

    class GradientWatcher(pl.Callback):
        def on_after_backward(self, trainer: Any, module: Any) -> None:
            seen.append(trainer.global_step)

    want = _lightning_fit(_lightning_module(), GradientWatcher())
    callback = _captured()
    got = _lightning_fit(_lightning_module(), GradientWatcher(), callback)
    _assert_same_fit(got, want)
    reason = callback.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.PYTHON_STATE
    assert reason.op == f"{GradientWatcher.__qualname__}.on_after_backward"
    assert f"{HERE}:" in reason.where and "on_train_batch_end" in reason.hint
    # refused before the first step: Lightning's own loop runs every step, hooks included
    assert callback.stats().state is StepState.UNCAPTURED and callback.stats().recordings == 0
    assert len(seen) == 2 * STEPS


def test_lightning_grad_scaler_is_refused_and_the_fit_goes_on() -> None:
    from pytorch_lightning.plugins import MixedPrecision

    def fp16() -> Any:
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    want = _lightning_fit(_lightning_module(), plugins=[fp16()])
    callback = _captured()
    got = _lightning_fit(_lightning_module(), callback, plugins=[fp16()])
    _assert_same_fit(got, want)
    reason = callback.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.GRAD_SCALER, reason
    assert f"{HERE}:" in reason.where and "bfloat16" in reason.hint


def test_lightning_logging_a_host_value_is_refused_and_the_fit_goes_on() -> None:
    """``self.log(name, loss.item())``: on CUDA the ``.item()`` is a refused host
    synchronization (``SYNC_OP``); on the host the step returns the Python float."""
    want = _lightning_fit(_lightning_module(lambda loss: loss.item()))
    callback = _captured()
    got = _lightning_fit(_lightning_module(lambda loss: loss.item()), callback)
    _assert_same_fit(got, want)
    reason = callback.stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.HOST_OUTPUT, reason
    assert callback.stats().state is StepState.UNCAPTURED


# --- Hugging Face Trainer -----------------------------------------------------------------


def _hf_fit(
    trainer_class: Any, root: Path, accumulation: int = 1, **kwargs: Any
) -> tuple[list[float], list[torch.Tensor], Any]:
    import transformers

    losses: list[float] = []

    class Recording(trainer_class):  # type: ignore[misc,valid-type]
        def training_step(self, *args: Any, **kw: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kw)
            losses.append(float(loss))
            return loss

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4 * STEPS):
        ids = torch.randint(0, VOCAB, (16,), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    torch.manual_seed(0)
    model = build_gpt2(layers=1)
    args = transformers.TrainingArguments(
        output_dir=str(root),
        max_steps=STEPS // accumulation,
        gradient_accumulation_steps=accumulation,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs.pop("args", {}),
    )
    trainer = Recording(model=model, args=args, train_dataset=data, **kwargs)
    trainer.train()
    return losses, [p.detach().clone() for p in model.parameters()], trainer


@pytest.mark.parametrize("accumulation", [1, 2], ids=["step", "accumulate_2"])
def test_hf_capture_step_trainer_matches_the_plain_trainer(
    tmp_path: Path, accumulation: int
) -> None:
    import transformers

    want, want_params, _ = _hf_fit(transformers.Trainer, tmp_path / "plain", accumulation)
    got, params, trainer = _hf_fit(
        torchloom.trainers.CaptureStepTrainer,
        tmp_path / "captured",
        accumulation,
        capturer=loom_cudagraph.HostCapturer(),
    )
    assert got == want and len(got) == STEPS
    for p, q in zip(params, want_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    stats = trainer.capture_step_stats()
    assert stats.refusal is None and stats.state is StepState.CAPTURED, stats.format()
    assert stats.warmup_calls == 3 and stats.replays >= STEPS - 3 - 2, stats.format()


def test_hf_setting_a_replay_would_not_honour_is_refused_and_training_goes_on(
    tmp_path: Path,
) -> None:
    import transformers

    class MyTrainer(torchloom.trainers.HFCaptureStep, transformers.Trainer):  # type: ignore[misc]
        """The mixin goes on any Trainer subclass."""

    empty = {"torch_empty_cache_steps": 1}
    want, _, _ = _hf_fit(transformers.Trainer, tmp_path / "plain", args=empty)
    got, _, trainer = _hf_fit(
        MyTrainer,
        tmp_path / "captured",
        args=empty,
        capturer=loom_cudagraph.HostCapturer(),
    )
    assert got == want
    reason = trainer.capture_step_stats().refusal
    assert reason is not None and reason.kind is StepRefusalKind.PYTHON_STATE
    assert reason.op == "torch_empty_cache_steps" and "unset" in reason.hint
