"""The grad-hook stage: ``torchloom.grad_hook`` hooks inlined into the compiled backward.

Only hooks a forward has stored can be traced, so a graph with ``grad_hook``
sites has its backward compiled at its first call, also when the cache stage
would compile it ahead of time (the cache then stores the entry after that
compile). Before codegen of a backward graph, each ``loom.grad_hook`` node
whose hooks the hook tracer accepts gets their tensor work copied into the
graph, with a ``loom.grad_hook_replay`` op that replays their side effects per
call (and runs the hooks as Python for a call whose hooks do not match the
trace). Every site inlined or kept as a Python call, and why, is an entry of
``torchloom.report()`` under the area ``"grad_hooks"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

import loom_hops
from torchloom import _torch_compat as compat
from torchloom._stages import GraphContext, GraphKind, PipelineStage

__all__ = ["GradHooksStage"]


class GradHooksStage(PipelineStage):
    """Inlines traced ``torchloom.grad_hook`` hooks into backward graphs."""

    name = "grad_hooks"

    def wrap_backend(
        self,
        ctx: GraphContext,
        example_inputs: Sequence[Any],
        compile_cold: Callable[[], Callable[..., Any]],
    ) -> Callable[..., Any]:
        if not loom_hops.grad_hook_sites(ctx.dynamo_gm):
            return compile_cold()
        with compat.lazy_backward_lowering():
            return compile_cold()

    def before_codegen(
        self, ctx: GraphContext, gm: GraphModule, kind: GraphKind, example_inputs: Sequence[Any]
    ) -> GraphModule:
        if kind is not GraphKind.BACKWARD:
            return gm
        table = compat.inductor_decompositions() if ctx.options.codegen == "inductor" else None
        inlining = loom_hops.inline_grad_hooks(gm, table)
        for site in inlining.inlined:
            ctx.record.add_entry(
                "grad_hooks", "inlined", f"grad_hook site {site}: traced and inlined", site=site
            )
        for site, why in inlining.kept_opaque:
            ctx.record.add_entry(
                "grad_hooks",
                "python_call",
                f"grad_hook site {site}: runs as Python: {why}",
                site=site,
            )
        return inlining.result.graph_module
