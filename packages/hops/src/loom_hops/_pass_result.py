"""The value every ``loom_hops`` graph pass returns: the module and whether it changed."""

from __future__ import annotations

import dataclasses

import torch.fx

__all__ = ["PassResult"]


@dataclasses.dataclass(frozen=True, slots=True)
class PassResult:
    """What a pass returns (the torch.fx ``PassResult`` shape, frozen)."""

    graph_module: torch.fx.GraphModule
    modified: bool
