"""The values the pipeline's steps hand each other.

:class:`Snapshot` is what one compilation depends on, taken once when Dynamo
calls the backend; every later step reads it and none changes it. The steps'
own results (the hooks plan, the resize plan, the cache key, the compiled
graph) are frozen values defined beside the step that makes them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

import loom_hops
from torchloom._options import LoomOptions
from torchloom._report import GraphRecordBuilder

__all__ = ["Codegen", "ExampleInputs", "GraphKind", "Snapshot"]


class GraphKind(enum.Enum):
    """Which AOTAutograd graph is being compiled."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


#: Compiles one aten graph: ``codegen(gm, example_inputs, static_input_idxs)``
#: returns a boxed callable (takes a list of inputs, may clear it).
Codegen = Callable[[GraphModule, Sequence[Any], Sequence[int]], Callable[..., Any]]


class ExampleInputs:
    """Dynamo's example inputs for one compile, held until the backend returns.

    They are the first call's real tensors (for a graph after a graph break,
    activations of the previous graph's first call): kept by the compiled
    function, they would stay allocated as long as it lives. AOTAutograd keeps
    loom's compilers (and so the snapshot) for the lazy backward compile, which
    does not read them, so :meth:`release` drops them when the backend returns.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]) -> None:
        self._values: tuple[Any, ...] | None = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        if self._values is None:
            raise RuntimeError(
                "torchloom: the example inputs of this graph were released when its "
                "compile returned; read what is needed from them during the compile"
            )
        return self._values

    def release(self) -> None:
        self._values = None


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """The context of one compilation: Dynamo's graph and inputs, the resolved
    options, the saved-tensor hooks active when Dynamo called the backend, and
    whether the graph has ``grad_hook`` sites. ``record`` is the graph's report
    builder, the one mutable thing every step writes to; ``inputs`` holds the
    example inputs until the compile returns (:class:`ExampleInputs`)."""

    gm: GraphModule
    inputs: ExampleInputs
    options: LoomOptions
    record: GraphRecordBuilder
    hook_pair: loom_hops.HookPair | None
    grad_hook_sites: bool

    @property
    def example_inputs(self) -> tuple[Any, ...]:
        return self.inputs.values

    @property
    def graph_id(self) -> int:
        return self.record.graph_id
