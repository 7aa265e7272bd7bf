"""The extension points of the pipeline, and the stages plugged into them.

A :class:`PipelineStage` is how a torchloom package takes part in a
compilation. The pipeline calls every stage in :data:`STAGES` order at each
point below; every method is a no-op by default, so a stage overrides only the
points it needs::

    compile_graph(dynamo_gm, example_inputs)
     ├─ wrap_backend        (may answer the whole graph, e.g. a cache hit)
     ├─ before_aot          (Dynamo graph, torch IR)
     ├─ AOTAutograd
     │   ├─ after_partition (forward and backward aten graphs)
     │   └─ per graph (forward / backward / inference):
     │       ├─ before_codegen
     │       ├─ compile         (first stage returning a callable wins;
     │       │                    else the codegen callback compiles the graph)
     │       └─ wrap_compiled
     └─ wrap_runtime        (the callable handed back to Dynamo)

A stage refuses a graph by raising :class:`~torchloom.LoomRefusal`; the
pipeline falls back to eager (or re-raises in strict mode).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch.fx import GraphModule

from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
from torchloom._options import LoomOptions
from torchloom._report import GraphRecordBuilder

__all__ = ["STAGES", "Codegen", "GraphContext", "GraphKind", "PipelineStage"]


class GraphKind(enum.Enum):
    """Which AOTAutograd graph is being compiled."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


#: Compiles one aten graph: ``codegen(gm, example_inputs, static_input_idxs)``
#: returns a boxed callable (takes a list of inputs, may clear it).
Codegen = Callable[[GraphModule, Sequence[Any], Sequence[int]], Callable[..., Any]]


@dataclasses.dataclass
class GraphContext:
    """Per-Dynamo-graph state shared by every stage during one compilation.

    ``state`` is a scratch space keyed by stage name: a stage keeps what it
    needs between its hook calls there (e.g. the hooks snapshot taken in
    ``before_aot`` and used in ``after_partition``).
    """

    options: LoomOptions
    record: GraphRecordBuilder
    dynamo_gm: GraphModule
    example_inputs: Sequence[Any]
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def graph_id(self) -> int:
        return self.record.graph_id

    def refuse(self, explanation: str, *, where: str = "", hint: str = "") -> LoomRefusal:
        """An exception to raise when a stage cannot handle this graph."""
        return LoomRefusal(Unsupported(RefusalKind.STAGE_REFUSED, where, explanation, hint))


class PipelineStage:
    """Base class of a pipeline stage: override the points you need."""

    #: Short name, used as the report area and the ``GraphContext.state`` key.
    name: ClassVar[str] = "stage"

    def wrap_backend(
        self,
        ctx: GraphContext,
        example_inputs: Sequence[Any],
        compile_cold: Callable[[], Callable[..., Any]],
    ) -> Callable[..., Any]:
        """Around the whole compilation of one Dynamo graph.

        ``compile_cold()`` runs the rest of the pipeline (the later stages'
        ``wrap_backend`` included) and returns the callable for Dynamo. A stage
        may return something else instead (a cache hit), or call it and keep
        what it returned (a cache store).
        """
        return compile_cold()

    def before_aot(
        self, ctx: GraphContext, gm: GraphModule, example_inputs: Sequence[Any]
    ) -> GraphModule:
        """The Dynamo graph (torch IR) before AOTAutograd traces it."""
        return gm

    def after_partition(
        self, ctx: GraphContext, fw_gm: GraphModule, bw_gm: GraphModule
    ) -> tuple[GraphModule, GraphModule]:
        """The forward and backward graphs the partitioner produced (training only)."""
        return fw_gm, bw_gm

    def before_codegen(
        self, ctx: GraphContext, gm: GraphModule, kind: GraphKind, example_inputs: Sequence[Any]
    ) -> GraphModule:
        """One aten graph (forward, backward or inference) before codegen."""
        return gm

    def wrap_codegen(
        self, ctx: GraphContext, gm: GraphModule, kind: GraphKind, codegen: Codegen
    ) -> Codegen:
        """Change how one aten graph is generated (e.g. with an Inductor setting
        patched); every stage's ``compile`` and the default path use the result."""
        return codegen

    def compile(
        self,
        ctx: GraphContext,
        gm: GraphModule,
        kind: GraphKind,
        example_inputs: Sequence[Any],
        static_input_idxs: Sequence[int],
        codegen: Codegen,
    ) -> Callable[..., Any] | None:
        """Take over the compilation of one aten graph (e.g. split it into
        CUDA-graph segments and ``codegen`` each one); ``None`` declines."""
        return None

    def wrap_compiled(
        self,
        ctx: GraphContext,
        fn: Callable[..., Any],
        gm: GraphModule,
        kind: GraphKind,
        example_inputs: Sequence[Any],
    ) -> Callable[..., Any]:
        """The boxed compiled callable of one aten graph."""
        return fn

    def wrap_runtime(self, ctx: GraphContext, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The callable handed back to Dynamo for this graph (positional args)."""
        return fn


#: The stages the pipeline runs, in order. Packages append theirs here.
STAGES: list[PipelineStage] = []

from torchloom._stage_hooks import SavedTensorHooksStage  # noqa: E402

STAGES.append(SavedTensorHooksStage())

from torchloom._stage_resize import ResizeStage  # noqa: E402

STAGES.append(ResizeStage())

# NOTE: before the cache stage, whose eager OutputCode would otherwise take over compile.
from torchloom._stage_cudagraph import CudagraphStage  # noqa: E402

STAGES.append(CudagraphStage())

from torchloom._stage_cache import CacheStage  # noqa: E402

STAGES.append(CacheStage())

from torchloom._stage_grad_hooks import GradHooksStage  # noqa: E402

STAGES.append(GradHooksStage())
