"""Closure cells for the hook tracer: one model for every cell (pre-existing cells identified by the cell object, cells created while tracing, cells shared with nested functions), reads that become guards and writes that become side effects. Pure Python: it never imports torch."""

from loom_sidefx import Guard, GuardKind, compile_guards

from ._frame import FrameCells
from ._model import Cell, CellCheckpoint, CellModel, GuardPolicy, default_guard_policy
from ._refusals import CellRefusalKind, CellRefused, Unsupported

__version__ = "0.1.0"

__all__ = [
    "Cell",
    "CellCheckpoint",
    "CellModel",
    "CellRefusalKind",
    "CellRefused",
    "FrameCells",
    "Guard",
    "GuardKind",
    "GuardPolicy",
    "Unsupported",
    "__version__",
    "compile_guards",
    "default_guard_policy",
]
