"""The resize steps: FSDP-style storage resizing inside compiled graphs (``loom_resize``).

:func:`plan_resizes` makes the graph's one :class:`loom_resize.ResizePlan`
while preparing (unsound resizes are refused there: eager fallback with the
reason, or a raise in strict mode). Before AOTAutograd, :func:`rewrite_fills`
turns the fills of resized parameters (``copy_``, ``_foreach_copy_``) into
``fsdp.copy_``, which AOTAutograd keeps as an in-place mutation of the
parameter itself. On every aten graph :func:`resize_passes` removes
``resize_(full) -> copy_ -> resize_(0)`` chains (option
``resize_remove_chains``) and places resizes to zero after the input's last
read. :func:`guard_storage_sizes` wraps the runtime. Every change and every
pattern left alone is an entry of ``torchloom.report()`` under ``"resize"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

import loom_resize
import loom_sidefx
from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
from torchloom._options import LoomOptions
from torchloom._report import GraphRecordBuilder
from torchloom._values import GraphKind, Snapshot

__all__ = ["guard_storage_sizes", "plan_resizes", "resize_passes", "rewrite_fills"]

log = logging.getLogger("torchloom.resize")


def _record(
    record: GraphRecordBuilder, graph: str, name: str, result: loom_sidefx.PassResult[GraphModule]
) -> None:
    record.add_plan(f"resize.{graph}.{name}", result)
    for change in result.changes:
        record.add_entry(
            "resize", change.pass_name, f"{graph}: {change.where}: {change.what}", graph=graph
        )
    for reason in result.left_alone:
        record.add_entry(
            "resize",
            "left_alone",
            f"{graph}: {reason}",
            graph=graph,
            kind_=reason.kind.value,
            refusal=reason,
        )


def _refusal(
    record: GraphRecordBuilder, reason: loom_resize.Unsupported, graph: str
) -> LoomRefusal:
    record.add_entry(
        "resize", "refused", f"{graph}: {reason}", kind_=reason.kind.value, refusal=reason
    )
    return LoomRefusal(
        Unsupported(
            RefusalKind.STAGE_REFUSED,
            reason.where,
            f"loom_resize: {reason.explanation}",
            reason.hint,
            cause=reason,
        )
    )


def plan_resizes(snapshot: Snapshot) -> loom_resize.ResizePlan:
    """The resized inputs of Dynamo's graph, from the storage sizes the example
    inputs have; raises :class:`~torchloom.LoomRefusal` for what cannot be
    functionalized."""
    loom_resize.record_input_storage(snapshot.gm, snapshot.example_inputs)
    try:
        return loom_resize.plan_storage_resizes(snapshot.gm)
    except loom_resize.ResizeRefused as refused:
        raise _refusal(snapshot.record, refused.reason, "dynamo") from None


def rewrite_fills(snapshot: Snapshot, gm: GraphModule, plan: loom_resize.ResizePlan) -> GraphModule:
    """Dynamo's graph before AOTAutograd: fills of resized inputs as ``fsdp.copy_``."""
    if not plan:
        return gm
    loom_resize.record_input_storage(gm, snapshot.example_inputs)
    try:
        result = loom_resize.rewrite_fills_as_fsdp_copy(gm, plan)
    except loom_resize.ResizeRefused as refused:
        raise _refusal(snapshot.record, refused.reason, "dynamo") from None
    for info in plan.inputs:
        snapshot.record.add_entry("resize", "input", f"dynamo: {info}", case=info.case.value)
    _record(snapshot.record, "dynamo", "rewrite_fills_as_fsdp_copy", result)
    return result.graph_module


def resize_passes(
    record: GraphRecordBuilder, options: LoomOptions, gm: GraphModule, kind: GraphKind
) -> GraphModule:
    """One aten graph before codegen: chains removed, shrinks after the last use."""
    unchanged = loom_sidefx.PassResult(gm, False)
    try:
        # NOTE: both passes start from the graph's resize plan: with no resized input
        # neither changes anything, and their modules are not imported.
        resized = bool(loom_resize.plan_storage_resizes(gm))
        if options.resize_remove_chains:
            result = loom_resize.remove_resize_copy_resize(gm) if resized else unchanged
            _record(record, kind.value, "remove_resize_copy_resize", result)
            gm = result.graph_module
        result = loom_resize.move_shrinks_after_last_use(gm) if resized else unchanged
    except loom_resize.ResizeRefused as refused:
        raise _refusal(record, refused.reason, kind.value) from None
    _record(record, kind.value, "move_shrinks_after_last_use", result)
    return result.graph_module


def guard_storage_sizes(
    fn: Callable[..., Any], snapshot: Snapshot, plan: loom_resize.ResizePlan
) -> Callable[..., Any]:
    """Guard the compiled graph on the storage sizes its resized inputs had.

    The passes decide from those sizes (an input entering empty and leaving
    empty needs no mutation at all), and Dynamo does not guard on storage
    sizes; a call whose inputs enter with other sizes runs the graph eagerly.
    """
    if not plan:
        return fn
    expected = tuple((i.position, i.name, i.start_nbytes) for i in plan.inputs if i.position)
    eager, record = snapshot.gm.forward, snapshot.record
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
                        record.graph_id,
                        name,
                        got,
                        nbytes,
                    )
                    record.add_entry(
                        "resize",
                        "guard_failed",
                        f"input {name!r} entered with {got} bytes, compiled for {nbytes}; "
                        "ran eagerly",
                    )
                return eager(*args)
        return fn(*args)

    return guarded
