"""Dynamo's DDP optimizer: the first call of each bucket's graph is on fake tensors.

Under ``torch.compile(DDP(model))`` Dynamo splits the frame's graph at DDP's bucket
boundaries and compiles each piece with the backend
(``torch/_dynamo/backends/distributed.py``, ``SubmodCompiler.run_node``). For a
piece compiled through AOTAutograd it sets ``TracingContext.fakify_first_call``
around the compile, then calls the compiled piece once, on fake tensors and under
the fake mode, to get fake outputs (with the strides the compiled code will give)
to compile the next piece with. AOTAutograd answers that call itself on a cold
compile (``FakifiedOutWrapper``: the compiled forward does not run). A graph
served from loom's cache has no such wrapper, so Inductor's generated code ran on
fake tensors ("Cannot access data pointer of Tensor" on CUDA, "Unhandled
FakeTensor Device Propagation" on CPU): identical buckets (a transformer's
blocks) hit the entry the first bucket stored, in the very first run.

:func:`answer_fake_first_call` answers that first call above loom's runtime, for
every compiled graph: a cold one through AOTAutograd's own wrapper, a served one
by running Dynamo's graph on the fake tensors. Neither runs a kernel, records a
CUDA graph, replays a hook's pack effects or counts a call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

import loom_hops
from torchloom import _torch_compat as compat

__all__ = ["answer_fake_first_call"]


def answer_fake_first_call(
    runtime: Callable[..., Any], aot_fn: Callable[..., Any] | None, gm: GraphModule
) -> Callable[..., Any]:
    """``runtime`` with the DDP optimizer's fake first call answered, when this
    compile is one of its buckets (``fakify_first_call``); ``runtime`` itself otherwise.

    ``aot_fn``: AOTAutograd's callable of a cold compile (its ``FakifiedOutWrapper``
    gives the fake outputs with Inductor's strides), ``None`` for a graph served from
    the cache (``gm``, Dynamo's graph, runs on the fake tensors instead). A first call
    with real tensors goes to ``runtime``; after the first call only ``runtime`` runs.
    """
    if not compat.fakify_first_call():
        return runtime
    pending: list[GraphModule] = [gm]

    def first_call_fake(*args: Any) -> Any:
        if pending:
            graph = pending.pop()
            if compat.is_fake_call(args):
                # NOTE: autograd must not pack fake tensors through the user's hooks
                # (their side effects would count a call that never ran).
                with loom_hops.eager_saved_tensors_hooks_disabled():
                    if aot_fn is not None:
                        return aot_fn(*args)
                    return compat.fake_outputs_of(graph, args)
        return runtime(*args)

    return first_call_fake
