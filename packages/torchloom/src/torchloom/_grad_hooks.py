"""The grad-hook step: ``torchloom.grad_hook`` hooks inlined into the compiled backward.

Only hooks a forward has stored can be traced, so a graph with ``grad_hook``
sites has its backward compiled at its first call (:func:`grad_hooks_context`),
also when the cache would compile it ahead of time (the cache then stores the
entry after that compile). Before codegen of a backward graph,
:func:`inline_grad_hooks` copies the tensor work of each ``loom.grad_hook``
node whose hooks the hook tracer accepts into the graph, with a
``loom.grad_hook_replay`` op that replays their side effects per call (and runs
the hooks as Python for a call whose hooks do not match the trace). Every site
inlined or kept as a Python call, and why, is an entry of ``torchloom.report()``
under the area ``"grad_hooks"``.
"""

from __future__ import annotations

import contextlib

from torch.fx import GraphModule

import loom_hops
from torchloom import _torch_compat as compat
from torchloom._aot_cache import lazy_backward_lowering
from torchloom._values import GraphKind, Snapshot

__all__ = ["grad_hooks_context", "inline_grad_hooks"]


def grad_hooks_context(snapshot: Snapshot) -> contextlib.AbstractContextManager[None]:
    """Around the compile: a graph with ``grad_hook`` sites lowers its backward lazily."""
    return lazy_backward_lowering() if snapshot.grad_hook_sites else contextlib.nullcontext()


def inline_grad_hooks(snapshot: Snapshot, gm: GraphModule, kind: GraphKind) -> GraphModule:
    """A backward graph before codegen: traced ``grad_hook`` hooks inlined."""
    # NOTE: a backward calls loom.grad_hook only where its forward called
    # loom.grad_tap (the op's autograd formula): without sites in Dynamo's graph there
    # is nothing to inline, and the hook tracer is not imported.
    if kind is not GraphKind.BACKWARD or not snapshot.grad_hook_sites:
        return gm
    record, options = snapshot.record, snapshot.options
    table = compat.inductor_decompositions() if options.codegen == "inductor" else None
    inlining = loom_hops.inline_grad_hooks(gm, table)
    record.add_plan("grad_hooks", inlining)
    for site in inlining.inlined:
        record.add_entry(
            "grad_hooks", "inlined", f"grad_hook site {site}: traced and inlined", site=site
        )
    for site, why in inlining.kept_opaque:
        record.add_entry(
            "grad_hooks", "python_call", f"grad_hook site {site}: runs as Python: {why}", site=site
        )
    return inlining.result.graph_module
