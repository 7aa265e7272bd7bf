"""The resize stage: FSDP-style storage resizing inside compiled graphs (``loom_resize``).

Before AOTAutograd, the fills of resized parameters (``copy_``,
``_foreach_copy_``) become ``fsdp.copy_``, which AOTAutograd keeps as an
in-place mutation of the parameter itself; unsound resizes are refused there
(eager fallback with the reason, or a raise in strict mode). On every aten
graph (forward, backward, inference) ``resize_(full) -> copy_ -> resize_(0)``
chains are removed (option ``resize_remove_chains``) and resizes to zero are
placed after the input's last read. Every change and every pattern left alone
is an entry of ``torchloom.report()`` under the area ``"resize"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

import loom_resize
from torchloom._stages import GraphContext, GraphKind, PipelineStage

__all__ = ["ResizeStage"]

log = logging.getLogger("torchloom.resize")


def _record(ctx: GraphContext, graph: str, result: loom_resize.PassResult) -> None:
    for change in result.changes:
        ctx.record.add_entry(
            "resize", change.pass_name, f"{graph}: {change.where}: {change.what}", graph=graph
        )
    for reason in result.left_alone:
        ctx.record.add_entry(
            "resize", "left_alone", f"{graph}: {reason}", graph=graph, kind_=reason.kind.value
        )


def _refuse(ctx: GraphContext, reason: loom_resize.Unsupported, graph: str) -> Exception:
    ctx.record.add_entry("resize", "refused", f"{graph}: {reason}", kind_=reason.kind.value)
    return ctx.refuse(f"loom_resize: {reason.explanation}", where=reason.where, hint=reason.hint)


class ResizeStage(PipelineStage):
    """Functionalizes FSDP-style storage resizes and removes resize/copy/resize chains."""

    name = "resize"

    def wrap_backend(
        self,
        ctx: GraphContext,
        example_inputs: Sequence[Any],
        compile_cold: Callable[[], Callable[..., Any]],
    ) -> Callable[..., Any]:
        """Guard the compiled graph on the storage sizes its resized inputs had.

        The passes decide from those sizes (an input entering empty and leaving
        empty needs no mutation at all), and Dynamo does not guard on storage
        sizes; a call whose inputs enter with other sizes runs the graph eagerly.
        Wrapping here, outside the cache stage, keeps the guard on cache hits.
        """
        gm = ctx.dynamo_gm
        loom_resize.record_input_storage(gm, example_inputs)
        try:
            plan = loom_resize.plan_storage_resizes(gm)
        except loom_resize.ResizeRefused as refused:
            raise _refuse(ctx, refused.reason, "dynamo") from None
        compiled = compile_cold()
        if not plan:
            return compiled
        expected = tuple((i.position, i.name, i.start_nbytes) for i in plan.inputs if i.position)
        eager = gm.forward
        warned: list[str] = []

        def guarded(*args: Any) -> Any:
            for position, name, nbytes in expected:
                value: Any = args
                for i in position:
                    value = value[i]
                got = value.untyped_storage().nbytes()
                if got != nbytes:
                    if name not in warned:
                        warned.append(name)
                        log.warning(
                            "graph %d runs eagerly: input %r entered with %d storage bytes, "
                            "compiled for %d",
                            ctx.graph_id,
                            name,
                            got,
                            nbytes,
                        )
                        ctx.record.add_entry(
                            "resize",
                            "guard_failed",
                            f"input {name!r} entered with {got} bytes, compiled for {nbytes}; "
                            "ran eagerly",
                        )
                    return eager(*args)
            return compiled(*args)

        return guarded

    def before_aot(
        self, ctx: GraphContext, gm: GraphModule, example_inputs: Sequence[Any]
    ) -> GraphModule:
        loom_resize.record_input_storage(gm, example_inputs)
        try:
            result = loom_resize.rewrite_fills_as_fsdp_copy(gm)
        except loom_resize.ResizeRefused as refused:
            raise _refuse(ctx, refused.reason, "dynamo") from None
        plan = loom_resize.plan_storage_resizes(gm)
        for info in plan.inputs:
            ctx.record.add_entry("resize", "input", f"dynamo: {info}", case=info.case.value)
        _record(ctx, "dynamo", result)
        return result.graph_module

    def before_codegen(
        self, ctx: GraphContext, gm: GraphModule, kind: GraphKind, example_inputs: Sequence[Any]
    ) -> GraphModule:
        try:
            if ctx.options.resize_remove_chains:
                result = loom_resize.remove_resize_copy_resize(gm)
                _record(ctx, kind.value, result)
                gm = result.graph_module
            result = loom_resize.move_shrinks_after_last_use(gm)
        except loom_resize.ResizeRefused as refused:
            raise _refuse(ctx, refused.reason, kind.value) from None
        _record(ctx, kind.value, result)
        return result.graph_module
