"""Backward hooks on intermediate tensors: several hooks on one tensor run in eager order.

Dynamo 2.11 turns ``y.register_hook(h)`` on an intermediate into an identity
``autograd_function_apply(fwd_body, bwd_body, y)`` whose backward calls the
hook, placed right after ``y`` with every use of ``y`` redirected to its
result. A second hook on the same tensor wraps the first one's result, so the
chain is ``y -> apply(h0) -> apply(h1) -> uses`` and the backward runs ``h1``
before ``h0``: the reverse of eager, which runs hooks in registration order.
:func:`order_intermediate_hooks` swaps the backward bodies along each such
chain. Dynamo 2.13 emits a ``register_hook`` HOP instead; the pattern does not
occur there and the pass changes nothing.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from loom_hops._torch_compat import autograd_function_apply_op
from loom_sidefx import PassResult

__all__ = ["order_intermediate_hooks"]

log = logging.getLogger("torchloom.hops")

_GRAD_MODE_CALLS = ("_set_grad_enabled",)


def _body(gm: torch.fx.GraphModule, node: object) -> torch.fx.GraphModule | None:
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    body = getattr(gm, str(node.target), None)
    return body if isinstance(body, torch.fx.GraphModule) else None


def _is_hook_apply(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """An identity forward (``y.view_as(y)``) around one tensor: a 2.11 tensor hook."""
    if node.op != "call_function" or node.target is not autograd_function_apply_op():
        return False
    if len(node.args) != 3 or node.kwargs.get("saved_for_backward_idx") not in ([], ()):
        return False
    fwd = _body(gm, node.args[0])
    if fwd is None or _body(gm, node.args[1]) is None:
        return False
    calls = [n for n in fwd.graph.nodes if n.op not in ("placeholder", "output")]
    work = [n for n in calls if getattr(n.target, "__name__", n.target) not in _GRAD_MODE_CALLS]
    return len(work) == 1 and work[0].op == "call_method" and work[0].target == "view_as"


def _only_result(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is operator.getitem and users[0].args[1] == 0:
        return users[0]
    return None


def order_intermediate_hooks(gm: torch.fx.GraphModule) -> PassResult[torch.fx.GraphModule]:
    """Make several ``register_hook`` hooks on one intermediate run in registration order.

    >>> order_intermediate_hooks(dynamo_gm).modified   # before AOTAutograd
    True
    """
    hooks = {n for n in gm.graph.nodes if _is_hook_apply(gm, n)}
    heads = [
        n
        for n in gm.graph.nodes
        if n in hooks
        and not (
            isinstance(n.args[2], torch.fx.Node)
            and n.args[2].target is operator.getitem
            and n.args[2].args[0] in hooks
        )
    ]
    changed = 0
    for head in heads:
        chain = [head]
        while (result := _only_result(chain[-1])) is not None:
            nxt = list(result.users)
            if len(nxt) != 1 or nxt[0] not in hooks or nxt[0].args[2] is not result:
                break
            chain.append(nxt[0])
        if len(chain) < 2:
            continue
        bodies = [n.args[1] for n in chain]
        for body in bodies:
            assert isinstance(body, torch.fx.Node)
            head.prepend(body)
        for node, body in zip(chain, reversed(bodies), strict=True):
            node.args = (node.args[0], body, node.args[2])
            node.meta["loom_pass"] = "order_intermediate_hooks"
        changed += 1
    if changed:
        gm.graph.lint()  # type: ignore[no-untyped-call]
        gm.recompile()
        log.debug("order_intermediate_hooks: reordered %d chain(s) of tensor hooks", changed)
    return PassResult(gm, bool(changed))
