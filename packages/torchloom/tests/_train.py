"""Shared by the CPU tests: train a compiled model beside its eager twin."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def train_like_eager(
    compiled: Callable[[torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    ref: torch.nn.Module,
    inputs: Iterable[torch.Tensor],
) -> None:
    """One backward per input through ``compiled`` (``model`` compiled) and ``ref``
    (its eager twin): each loss and every gradient equal; gradients reset after."""
    for x in inputs:
        loss, want = compiled(x), ref(x)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad, q.grad = None, None
        # NOTE: a loss held while the next forward replays blocks every earlier
        # segment of the pool (double buffering), a matter of its own
        del loss


__all__ = ["train_like_eager"]
