"""Place the resize of a shrinking input after the input's last use.

An input that enters with full storage and leaves with zero bytes is freed
by its resize; any read after that resize would see no data. AOTAutograd may
place reads (views it saves for backward, detaches) after the point where the
user freed the storage, so this pass moves the resize down to just after the
last node that reads the input or a view of it. It never moves a resize up:
that could cross another alias's read.
"""

from __future__ import annotations

import logging

from torch.fx import GraphModule, Node

from loom_resize import _torch_compat as compat
from loom_resize._nodes import finish_graph, is_resize
from loom_resize._plan import ResizeCase, plan_storage_resizes
from loom_sidefx import Change, PassResult

__all__ = ["move_shrinks_after_last_use"]

log = logging.getLogger("torchloom.resize")
PASS = "move_shrinks_after_last_use"


def _last_reader(order: dict[Node, int], target: Node) -> Node | None:
    readers: set[Node] = set()
    frontier = [target]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output" or is_resize(user) or user in readers:
                continue
            readers.add(user)
            if user.op == "call_function" and compat.is_view_op(user.target):
                frontier.append(user)
    return max(readers, key=order.__getitem__, default=None)


def move_shrinks_after_last_use(gm: GraphModule) -> PassResult[GraphModule]:
    """Move each shrinking input's ``resize_(0)`` after the input's last read.

    >>> move_shrinks_after_last_use(fw_gm).changes  # doctest: +SKIP
    """
    plan = plan_storage_resizes(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    changes: list[Change] = []
    for info in plan.inputs:
        if info.case is not ResizeCase.SHRINK or len(info.resizes) != 1 or info.fills:
            continue
        target, resize = by_name[info.name], by_name[info.resizes[0]]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last = _last_reader(order, target)
        if last is None or order[last] < order[resize]:
            continue
        last.append(resize)
        resize.meta["loom_pass"] = PASS
        changes.append(
            Change(PASS, f"input {target.name!r}", f"{resize.name} moved after {last.name}")
        )
    if changes:
        finish_graph(gm)
        log.debug("%s: %s", PASS, "; ".join(str(c) for c in changes))
    return PassResult(gm, bool(changes), tuple(changes))
