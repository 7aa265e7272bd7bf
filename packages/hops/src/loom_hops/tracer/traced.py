"""``TracedHook``: the result of tracing a hook, and how to run it.

The graph takes the tensors named by ``input_sources`` (evaluated on the
hook's call arguments) and returns ``num_user_outputs`` tensors of the hook's
return value followed by the tensors its side effects store (the replay plan's
``TensorSlot``s index this whole output tuple). ``replay.apply(outputs, args)``
then performs the side effects and rebuilds the return value.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .guards import Guard, GuardFn
from .replay import ReplayPlan
from .sources import Source


@dataclass(frozen=True, slots=True)
class TracedHook:
    """A hook as an aten-level functional graph + replay plan + guards + fingerprint.

    >>> traced = trace_hook(pack, (x,))             # doctest: +SKIP
    >>> if traced.check_guards(x):                  # doctest: +SKIP
    ...     packed = traced.run(x)                  # same result and side effects as pack(x)
    """

    fn: types.FunctionType | types.MethodType = field(repr=False)
    graph: torch.fx.GraphModule = field(repr=False)
    input_sources: tuple[Source, ...]
    num_user_outputs: int
    replay: ReplayPlan
    guards: tuple[Guard, ...]
    guard_fn: GuardFn = field(repr=False, compare=False)
    guard_source: str = field(repr=False)
    fingerprint: str
    opaque_calls: tuple[str, ...] = ()
    torch_graph: torch.fx.GraphModule | None = field(default=None, repr=False, compare=False)

    @property
    def opaque(self) -> bool:
        """True when the graph calls ``torch.fx.wrap``ped functions the fingerprint cannot see into."""
        return bool(self.opaque_calls)

    @property
    def num_effect_outputs(self) -> int:
        return self.replay.num_slots - self.num_user_outputs

    def check_guards(self, *args: Any) -> bool:
        """Whether this trace is valid for a call ``fn(*args)`` (cheap; run it on every call)."""
        return self.guard_fn(args)

    def graph_inputs(self, *args: Any) -> list[torch.Tensor]:
        """The graph's inputs for a call ``fn(*args)``."""
        return [source.resolve(args) for source in self.input_sources]

    def run(self, *args: Any) -> Any:
        """Do what ``fn(*args)`` does: run the graph, then apply the replay plan.

        The graph computes values, not autograd history: it runs under ``no_grad``.
        """
        with torch.no_grad():
            outputs = self.graph(*self.graph_inputs(*args))
        return self.replay.apply(tuple(outputs), args)

    def describe(self) -> str:
        lines = [
            f"hook {self.fn.__module__}.{self.fn.__qualname__}  fingerprint {self.fingerprint[:16]}"
        ]
        lines.append("inputs: " + ", ".join(s.describe() for s in self.input_sources))
        lines += ["guard: " + g.describe() for g in self.guards]
        lines.append(self.graph.code.strip())
        lines.append(self.replay.describe())
        return "\n".join(lines)
