"""The configurations ``dist_check.py`` runs, filed by name beside their code.

A configuration is a function of the parsed arguments and the rank's device that
returns its result (a dict holding a ``verdict``). Each family module registers its
own with :func:`register`; ``dist_check.py`` imports the family modules and runs
what :func:`configs` lists, by ``order`` and then by registration, so a new
configuration needs no edit of the runner. A name is registered once."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

Runner = Callable[[argparse.Namespace, torch.device], dict[str, Any]]

#: Where a configuration registered without an ``order`` runs: after every
#: configuration with an explicit one (``--config all`` runs them in this order).
LAST = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """A registered configuration: its ``--config`` name, the function that runs it,
    the family module that registered it, its place in ``--config all`` and whether
    it needs CUDA devices (such a configuration reports ``SKIP`` on CPU itself)."""

    name: str
    run: Runner
    family: str
    order: int
    gpu_only: bool


_REGISTERED: dict[str, Config] = {}


def register(name: str, *, order: int = LAST, gpu_only: bool = False) -> Callable[[Runner], Runner]:
    """File the decorated function as configuration ``name``."""

    def add(run: Runner) -> Runner:
        family = run.__module__.rpartition(".")[2]
        if name == "all":
            raise ValueError(f"{family}.{run.__name__}: 'all' names every configuration")
        if name in _REGISTERED:
            first = _REGISTERED[name]
            raise ValueError(
                f"configuration {name!r} registered twice: {first.family}.{first.run.__name__} "
                f"and {family}.{run.__name__}; give the second another name"
            )
        _REGISTERED[name] = Config(name, run, family, order, gpu_only)
        return run

    return add


def configs() -> tuple[Config, ...]:
    """Every registered configuration, in the order ``--config all`` runs them."""
    return tuple(sorted(_REGISTERED.values(), key=lambda c: c.order))
