"""The fingerprint of a traced hook: a sha256 that is stable across processes.

It covers the bytecode of the hook and of every function it inlined (code,
constants, names), the guards with their expected values, the process
constants the trace folded (``torch.cuda.is_available() -> True``), the graph's
canonical text, the replay plan and the tracer's format version, the Python
tag and torch version. It never uses ``id()``, salted ``hash()`` or reprs
that carry addresses, so a cache can key on it across processes.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Iterable, Sequence

import torch
import torch.fx

from loom_sidefx import Guard, GuardKind, ReplayPlan, Source

from ._predicates import describe_object, stable_repr
from ._pyversion import PY_TAG

FORMAT_VERSION = "loom-hook-tracer/2"


def code_text(code: types.CodeType) -> str:
    """Canonical text of a code object (nested code objects included, addresses excluded)."""
    consts = []
    for c in code.co_consts:
        consts.append(code_text(c) if isinstance(c, types.CodeType) else stable_repr(c))
    return "|".join(
        [
            code.co_qualname,
            code.co_code.hex(),
            ",".join(code.co_names),
            ",".join(code.co_varnames),
            ",".join(code.co_freevars),
            ",".join(code.co_cellvars),
            f"[{';'.join(consts)}]",
        ]
    )


def guard_text(guard: Guard) -> str:
    """A guard's text, naming what an IDENTITY guard holds (its ``describe`` names only the type)."""
    if guard.kind is GuardKind.IDENTITY:
        return f"{guard.source.describe()} is {describe_object(guard.expected)}"
    return guard.describe()


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The graph's code with placeholder names numbered by position."""
    text = gm.code
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for i, name in sorted(enumerate(placeholders), key=lambda p: -len(p[1])):
        text = text.replace(name, f"__in{i}__")
    return text


def compute_fingerprint(
    codes: Iterable[types.CodeType],
    guards: Sequence[Guard],
    inputs: Sequence[Source],
    graph: torch.fx.GraphModule,
    plan: ReplayPlan,
    num_user_outputs: int,
    input_numbers: Sequence[tuple[torch.dtype, torch.device] | None] = (),
    process_constants: Sequence[str] = (),
) -> str:
    h = hashlib.sha256()

    def add(part: str) -> None:
        h.update(part.encode())
        h.update(b"\x00")

    add(FORMAT_VERSION)
    add(PY_TAG)
    add(torch.__version__)
    seen: set[str] = set()
    for code in codes:
        text = code_text(code)
        if text not in seen:
            seen.add(text)
            add(text)
    for guard in guards:
        add(guard_text(guard))
    for source in inputs:
        add(source.describe())
    for number in input_numbers:  # a lifted number: its dtype and device
        add("tensor" if number is None else f"number {number[0]} {number[1]}")
    for call in process_constants:  # folded at trace time, not guarded
        add(f"process constant {call}")
    add(graph_text(graph))
    add(plan.describe())
    add(str(num_user_outputs))
    return h.hexdigest()
