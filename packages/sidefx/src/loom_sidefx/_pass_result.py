"""What every graph pass of every loom package returns: the graph, whether it
changed, what it changed and what it left alone (with the reason).

The ``torch.fx`` ``PassResult(graph_module, modified)`` shape plus a report, frozen.
It lives here, at the root of the dependency table, so that ``loom_resize`` and
``loom_hops`` share one type; ``loom_sidefx`` never imports torch, so the graph's
type is a parameter (``PassResult[torch.fx.GraphModule]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

from ._refusals import Refusal

__all__ = ["Change", "PassResult"]

GraphT = TypeVar("GraphT")


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One edit a pass made: which pass, on which input or node, and what."""

    pass_name: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.pass_name}: {self.where}: {self.what}"


@dataclasses.dataclass(frozen=True, slots=True)
class PassResult(Generic[GraphT]):
    """The result of one pass.

    ``changes`` lists the edits; ``left_alone`` the patterns the pass saw but did
    not touch, each with the reason (a :class:`Refusal` whose kind is not a
    refusal of the whole graph)::

        result = remove_resize_copy_resize(gm)
        if result.modified:
            log.debug("\n".join(result.lines()))
    """

    graph_module: GraphT
    modified: bool
    changes: tuple[Change, ...] = ()
    left_alone: tuple[Refusal[Any], ...] = ()

    def lines(self) -> tuple[str, ...]:
        """One line per change, then one per pattern left alone."""
        return tuple(str(c) for c in self.changes) + tuple(
            f"left alone {u}" for u in self.left_alone
        )
