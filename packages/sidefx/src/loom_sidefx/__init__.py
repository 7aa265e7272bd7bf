"""Symbolic values with a mutation type, the side-effect log of a traced hook, pruning of dead new objects, and the replay plan that applies recorded side effects, in program order, after a compiled graph runs. Pure Python: it never imports torch."""

__version__ = "0.1.0"

__all__ = ["__version__"]
