"""``TracedHook``: the result of tracing a hook, and how to run it.

The graph takes the tensors named by ``input_sources`` (evaluated on the
hook's call arguments; a number lifted from the closure, globals or an object,
``input_numbers[i]`` not ``None``, is passed as a 0-d tensor of that dtype and
device) and returns ``num_user_outputs`` tensors of the hook's
return value followed by the tensors its side effects store (the replay plan's
``TensorSlot``s index this whole output tuple). ``replay`` is a
``loom_sidefx.ReplayPlan``; ``replay_outputs(outputs, args)`` applies it on
the call's ``Roots`` (``roots(*args)``), performing the side effects, and
returns the hook's return value.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from loom_sidefx import ArgSource, Guard, ReplayPlan, Roots, Source


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
    guard_fn: Callable[[Roots], bool] = field(repr=False, compare=False)
    guard_source: str = field(repr=False)
    fingerprint: str
    #: Per input: ``(dtype, device)`` of a number lifted to a 0-d tensor, or ``None``.
    input_numbers: tuple[tuple[torch.dtype, torch.device] | None, ...] = ()
    opaque_calls: tuple[str, ...] = ()
    #: Calls evaluated at trace time because their result is fixed for the process
    #: (``"torch.cuda.is_available() -> False"``); in the fingerprint, not guarded.
    process_constants: tuple[str, ...] = ()
    #: Stream and event operations the trace dropped, each with the hook's line
    #: (``"torch.cuda.Stream.wait_stream at offload.py:12"``): the graph runs in program
    #: order on one stream, which satisfies them (``_streams``). Not in the fingerprint
    #: (the bytecode is); a lowering that uses streams must order the work itself.
    stream_ops: tuple[str, ...] = ()
    torch_graph: torch.fx.GraphModule | None = field(default=None, repr=False, compare=False)
    _input_getters: tuple[Callable[[Roots], Any], ...] = field(
        default=(), repr=False, compare=False
    )
    _globals: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _closure: tuple[types.CellType, ...] = field(default=(), repr=False, compare=False)

    @property
    def opaque(self) -> bool:
        """True when the graph calls ``torch.fx.wrap``ped functions the fingerprint cannot see into."""
        return bool(self.opaque_calls)

    @property
    def num_effect_outputs(self) -> int:
        return self.replay.num_tensor_slots - self.num_user_outputs

    def roots(self, *args: Any) -> Roots:
        """The ``loom_sidefx.Roots`` of a call ``fn(*args)`` (what sources and guards read)."""
        if self._globals is not None:
            return Roots(args, self._globals, self._closure)
        fn = self.fn.__func__ if isinstance(self.fn, types.MethodType) else self.fn
        return Roots(args, fn.__globals__, fn.__closure__ or ())

    def check_guards(self, *args: Any) -> bool:
        """Whether this trace is valid for a call ``fn(*args)`` (cheap; run it on every call)."""
        return self.guard_fn(self.roots(*args))

    @property
    def outside_inputs(self) -> tuple[int, ...]:
        """Indices of the inputs read from outside the call's arguments (the closure,
        globals or objects): closure tensors and lifted numbers."""
        return tuple(
            i for i, s in enumerate(self.input_sources) if not isinstance(s.root(), ArgSource)
        )

    def read_input(self, index: int, roots: Roots) -> torch.Tensor:
        """Input ``index`` on ``roots`` (a lifted number as its 0-d tensor)."""
        getters = self._input_getters or tuple(s.compile() for s in self.input_sources)
        value = getters[index](roots)
        number = self.input_numbers[index] if self.input_numbers else None
        if number is None:
            return value  # type: ignore[no-any-return]
        return torch.full((), value, dtype=number[0], device=number[1])

    def graph_inputs(
        self, *args: Any, outside: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The graph's inputs for a call ``fn(*args)``; ``outside`` gives the inputs
        read from outside the arguments (:attr:`outside_inputs`, in order) instead."""
        roots = self.roots(*args)
        given = dict(zip(self.outside_inputs, outside, strict=True)) if outside is not None else {}
        return [
            given[i] if i in given else self.read_input(i, roots)
            for i in range(len(self.input_sources))
        ]

    def replay_outputs(self, outputs: Sequence[Any], args: Sequence[Any]) -> Any:
        """Apply the replay plan after the graph ran with ``outputs``; return the hook's result."""
        return self.replay.apply(self.roots(*args), tuple(outputs))[0]

    def run(self, *args: Any) -> Any:
        """Do what ``fn(*args)`` does: run the graph, then apply the replay plan.

        The graph computes values, not autograd history: it runs under ``no_grad``.
        """
        with torch.no_grad():
            outputs = self.graph(*self.graph_inputs(*args))
        return self.replay_outputs(outputs, args)

    def describe(self) -> str:
        lines = [
            f"hook {self.fn.__module__}.{self.fn.__qualname__}  fingerprint {self.fingerprint[:16]}"
        ]
        lines.append("inputs: " + ", ".join(s.describe() for s in self.input_sources))
        lines += ["guard: " + g.describe() for g in self.guards]
        lines += ["process constant: " + c for c in self.process_constants]
        lines += ["dropped stream op: " + op for op in self.stream_ops]
        lines.append(self.graph.code.strip())
        lines.append(self.replay.describe())
        return "\n".join(lines)
