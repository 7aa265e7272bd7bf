"""The differential corpus: programs run under eager and compiled, then compared.

``PROGRAMS`` lists every :class:`Program` by family; ``run_differential`` runs
one of them. See ``docs/testing.md`` for the format and how to add a program.
"""

from __future__ import annotations

from . import programs_aliasing, programs_modes, programs_nets, programs_shapes
from ._differential import DifferentialResult, compile_copy, run_differential
from ._program import DEFAULT_TOLERANCES, Case, Program, Tolerance, gen, randint, randn

__all__ = [
    "DEFAULT_TOLERANCES",
    "PROGRAMS",
    "Case",
    "DifferentialResult",
    "Program",
    "Tolerance",
    "by_name",
    "compile_copy",
    "gen",
    "randint",
    "randn",
    "run_differential",
]

PROGRAMS: tuple[Program, ...] = (
    *programs_nets.PROGRAMS,
    *programs_aliasing.PROGRAMS,
    *programs_modes.PROGRAMS,
    *programs_shapes.PROGRAMS,
)


def by_name(name: str) -> Program:
    """The program called ``name`` (``KeyError`` listing the names otherwise)."""
    for program in PROGRAMS:
        if program.name == name:
            return program
    raise KeyError(f"no corpus program {name!r}; known: {', '.join(p.name for p in PROGRAMS)}")
