"""The trainers people use, with ``backend="loom"``: PyTorch Lightning's ``Trainer`` and
the Hugging Face ``Trainer`` fit a one-layer GPT-2 (built from a config with random
weights, nothing downloaded) with the recipes of ``docs/trainers.md``, and every
step's loss and the trained parameters equal eager's fit of the same model on the same
data (one seed; deterministic on CPU). loom compiles with eager codegen here (a CPU
Inductor compile costs tens of seconds on a 2-core machine) and must hand no graph back
to eager.

The Hugging Face ``Trainer``'s own switch, ``TrainingArguments(torch_compile_backend=
"loom")``, is refused by accelerate (its backend names are a fixed enum): a canary test
says so, and fails once accelerate takes the name, so that the docs can then say so.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from real_models import VOCAB, build_gpt2
from torch import nn

import torchloom

# NOTE: the builders import transformers after this line: nothing may be downloaded.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

#: loom on CPU: eager codegen (the recipe on a GPU leaves the options out).
LOOM = {"backend": "loom", "options": {"codegen": "eager"}}
STEPS, BATCH, SEQ = 4, 2, 16
TOL = {"rtol": 1e-6, "atol": 1e-6}

Params = list[torch.Tensor]


def _gpt2(compiled: bool) -> nn.Module:
    torch.manual_seed(0)
    model = build_gpt2(layers=1)
    if compiled:
        model.compile(**LOOM)  # in place: still a GPT2LMHeadModel, as both trainers expect
    return model


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(STEPS * BATCH)]


def _params(model: nn.Module) -> Params:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_fit(
    eager: tuple[list[float], Params], loom: tuple[list[float], Params], what: str
) -> None:
    (want_losses, want_params), (got_losses, got_params) = eager, loom
    assert len(got_losses) == len(want_losses) == STEPS, (got_losses, want_losses)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOL)
    for k, (p, q) in enumerate(zip(got_params, want_params, strict=True)):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, k=k: f"{what}: parameter {k}: {m}")


def _assert_loom_compiled(checkpoints: bool = False) -> None:
    """loom compiled the model's graphs itself (a graph handed back to eager would match
    eager trivially); with ``checkpoints``, activation checkpointing reached it."""
    report = torchloom.report()
    assert len(report) >= 1, "loom compiled nothing: the trainer ran the model uncompiled"
    fallbacks = [f"graph {g.graph_id}: {g.fallback}" for g in report if g.fallback]
    assert not fallbacks, "\n".join(fallbacks)
    if checkpoints:
        dynamo = [code for g in report for kind, code in g.graphs if kind == "dynamo"]
        assert any("tag_activation_checkpoint" in code for code in dynamo), report.format()


# --- PyTorch Lightning --------------------------------------------------------------------


def _lightning_fit(compiled: bool, root: Path) -> tuple[list[float], Params]:
    import pytorch_lightning as pl

    class CausalLM(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
            losses.append(float(outputs["loss"]))

    model = _gpt2(compiled)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Losses()],
    )
    loader = torch.utils.data.DataLoader(_sequences(), batch_size=BATCH)
    trainer.fit(CausalLM(model), loader)
    return losses, _params(model)


def test_lightning_fit_of_a_loom_compiled_gpt2_matches_eager(tmp_path: Path) -> None:
    eager = _lightning_fit(False, tmp_path / "eager")
    loom = _lightning_fit(True, tmp_path / "loom")
    _assert_same_fit(eager, loom, "lightning")
    _assert_loom_compiled()


# --- Hugging Face Trainer -----------------------------------------------------------------


def _training_arguments(root: Path, **kwargs: Any) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(root),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs,
    )


def _checkpointing_argument() -> dict[str, bool]:
    """``activation_checkpointing=True`` (``gradient_checkpointing`` before transformers 5.2x)."""
    import transformers

    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {name: True}


def _hf_fit(compiled: bool, root: Path, **kwargs: Any) -> tuple[list[float], Params, nn.Module]:
    import transformers

    losses: list[float] = []

    class Recording(transformers.Trainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kw: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kw)
            losses.append(float(loss))
            return loss

    dataset = [{"input_ids": s, "labels": s} for s in _sequences()]
    model = _gpt2(compiled)
    Recording(model=model, args=_training_arguments(root, **kwargs), train_dataset=dataset).train()
    return losses, _params(model), model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_hf_trainer_fit_of_a_model_compiled_by_hand_matches_eager(
    tmp_path: Path, checkpointing: bool
) -> None:
    kwargs = _checkpointing_argument() if checkpointing else {}
    losses, params, _ = _hf_fit(False, tmp_path / "eager", **kwargs)
    loom_losses, loom_params, model = _hf_fit(True, tmp_path / "loom", **kwargs)
    _assert_same_fit((losses, params), (loom_losses, loom_params), "hf trainer")
    _assert_loom_compiled(checkpoints=checkpointing)
    on = getattr(model, "is_activation_checkpointing", None)  # is_gradient_... before 5.2x
    assert (model.is_gradient_checkpointing if on is None else on) is checkpointing


def test_hf_trainer_torch_compile_backend_loom_is_still_refused_by_accelerate(
    tmp_path: Path,
) -> None:
    """accelerate's ``TorchDynamoPlugin`` turns the name into its ``DynamoBackend`` enum,
    which has no custom entry: the Trainer cannot be built. When this fails, accelerate
    takes the name: docs/trainers.md then gets the one-switch recipe."""
    import transformers

    args = _training_arguments(tmp_path, torch_compile=True, torch_compile_backend="loom")
    with pytest.raises(ValueError, match="'LOOM' is not a valid DynamoBackend"):
        transformers.Trainer(model=_gpt2(False), args=args, train_dataset=[])
