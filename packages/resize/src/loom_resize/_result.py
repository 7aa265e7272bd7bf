"""What a pass returns: the graph, whether it changed, and a report of what it
did and what it left alone (with the reason)."""

from __future__ import annotations

import dataclasses

from torch.fx import GraphModule

from loom_resize._errors import Unsupported

__all__ = ["Change", "PassResult"]


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One edit a pass made: which pass, on which input or node, and what."""

    pass_name: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.pass_name}: {self.where}: {self.what}"


@dataclasses.dataclass(frozen=True, slots=True)
class PassResult:
    """The result of one pass, shaped like ``torch.fx``'s ``PassResult`` plus a report.

    ``changes`` lists the edits; ``left_alone`` the patterns the pass saw but did
    not touch, each with the reason (an :class:`Unsupported` whose kind is not a
    refusal).
    """

    graph_module: GraphModule
    modified: bool
    changes: tuple[Change, ...] = ()
    left_alone: tuple[Unsupported, ...] = ()

    def lines(self) -> tuple[str, ...]:
        return tuple(str(c) for c in self.changes) + tuple(
            f"left alone {u}" for u in self.left_alone
        )
