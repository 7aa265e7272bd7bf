"""Shared fixtures: a Dynamo backend that runs the resize passes around
AOTAutograd with eager codegen, and recording of the graphs it saw."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx import GraphModule

import loom_resize
from loom_resize import _torch_compat as compat


@dataclasses.dataclass
class Recorder:
    """What the test backend saw and did for the last compiled graphs."""

    remove_chains: bool = True
    graphs: dict[str, GraphModule] = dataclasses.field(default_factory=dict)
    results: list[loom_resize.PassResult] = dataclasses.field(default_factory=list)

    def backend(self) -> Callable[[GraphModule, list[Any]], Any]:
        def aten_passes(kind: str) -> Callable[[GraphModule, Any], Any]:
            def compiler(gm: GraphModule, example_inputs: Any) -> Any:
                if self.remove_chains:
                    self.results.append(loom_resize.remove_resize_copy_resize(gm))
                self.results.append(loom_resize.move_shrinks_after_last_use(gm))
                self.graphs[kind] = gm
                return gm.forward

            return compiler

        aot = compat.aot_eager_backend(aten_passes("forward"), aten_passes("backward"))

        def backend(gm: GraphModule, example_inputs: list[Any]) -> Any:
            self.results.append(loom_resize.rewrite_fills_as_fsdp_copy(gm))
            self.graphs["dynamo"] = gm
            return aot(gm, example_inputs)

        return backend

    def code(self, kind: str) -> str:
        return self.graphs[kind].code

    def changes(self) -> list[str]:
        return [line for r in self.results for line in r.lines()]


@pytest.fixture
def recorder() -> Recorder:
    torch._dynamo.reset()
    return Recorder()
