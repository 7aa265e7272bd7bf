"""Preparing the active saved-tensor hook pair for compilation.

``prepare_saved_tensors_hooks`` decides what traces a :class:`HookPair` at each
saved tensor: ``GraphModule`` hooks are taken as they are, Python hooks go to a
:class:`PythonHookTracer` (by default the hook tracer, ``loom_tracer``), and
what cannot be compiled in is refused with the reason (compiled autograd owns
the region, one hook of each kind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.fx

from loom_hops._hook_graphs import GraphModuleHooks, HookGraphs
from loom_hops._hook_pair import HookPair
from loom_hops._python_hooks import trace_python_hooks
from loom_hops._torch_compat import in_compiled_autograd
from loom_hops._unsupported import HopsRefusalKind, Unsupported

__all__ = ["PythonHookTracer", "prepare_saved_tensors_hooks"]


class PythonHookTracer(Protocol):
    """Turns a Python hook pair into :class:`HookGraphs`, or says why not."""

    def __call__(
        self, pair: HookPair, decompositions: Mapping[Any, Callable[..., Any]] | None
    ) -> HookGraphs | Unsupported: ...


def prepare_saved_tensors_hooks(
    pair: HookPair,
    *,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    python_tracer: PythonHookTracer | None = None,
) -> HookGraphs | Unsupported:
    """What to trace the pair with at each saved tensor, or why it stays eager.

    ``GraphModule`` pairs are taken as they are; Python pairs go to
    ``python_tracer`` (default: ``loom_tracer`` through
    :class:`TracedPythonHooks`), which traces them at each saved tensor later.

    >>> graphs = prepare_saved_tensors_hooks(HookPair(pack_gm, unpack_gm))
    >>> isinstance(graphs, GraphModuleHooks)
    True
    """
    if in_compiled_autograd():
        return Unsupported(
            HopsRefusalKind.COMPILED_AUTOGRAD,
            pair.describe(),
            "compiled autograd owns saved tensors in this region; the hooks run eagerly",
        )
    if pair.kind == "graph_module":
        assert isinstance(pair.pack, torch.fx.GraphModule)
        assert isinstance(pair.unpack, torch.fx.GraphModule)
        return GraphModuleHooks(pair.pack, pair.unpack, decompositions)
    if pair.kind == "mixed":
        return Unsupported(
            HopsRefusalKind.MIXED_HOOK_KINDS,
            pair.describe(),
            "one hook is a GraphModule and the other a Python function",
            "give both hooks as GraphModules (torch.fx.symbolic_trace) or both as functions",
        )
    tracer = trace_python_hooks if python_tracer is None else python_tracer
    return tracer(pair, decompositions)
