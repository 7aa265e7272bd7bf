"""Closure cells for the hook tracer: one model for every cell (pre-existing cells identified by the cell object, cells created while tracing, cells shared with nested functions), reads that become guards and writes that become side effects. Pure Python: it never imports torch."""

__version__ = "0.1.0"

__all__ = ["__version__"]
