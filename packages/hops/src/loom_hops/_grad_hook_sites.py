"""The ``grad_hook`` call sites of a graph, found without registering ``grad_hook``'s ops.

Every graph a backend compiles is asked for its sites, and almost none has
any: the question must not cost the import that registers the ops
(``loom::grad_tap``, ``loom::grad_hook``) and the hook tracer behind their
inlining. Invariant: the answer is the same as a scan of the graph with every
op registered.
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch.fx

__all__ = ["grad_hook_sites"]

#: The module whose import registers ``loom::grad_tap`` and ``loom::grad_hook``.
_OPS_MODULE = "loom_hops._grad_hooks"
#: The module whose import registers ``loom::grad_hook_replay`` (an inlined backward's op).
_REPLAY_MODULE = "loom_hops._grad_hook_inline"


def grad_hook_sites(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """The ``grad_hook`` call sites of a Dynamo (or forward) graph, by site number.

    A backward compiler can trace a site's hooks only once a forward of that site
    has run: a graph with sites wants its backward compiled at the first backward,
    not ahead of time.
    """
    # NOTE: only the import of loom_hops._grad_hooks registers loom::grad_tap (the user
    # called grad_hook, or imported it): before it no graph can call the op, and the
    # answer is () without the import (and the registration) a scan would cost.
    if _OPS_MODULE not in sys.modules:
        return ()
    tap = torch.ops.loom.grad_tap
    sites = tuple(
        int(n.args[1])
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in (tap.default, tap)
    )
    if sites:
        # NOTE: a graph with sites may be served from a cache with a backward that
        # calls loom::grad_hook_replay: its op is registered before the graph runs.
        importlib.import_module(_REPLAY_MODULE)
    return sites
