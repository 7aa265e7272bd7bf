"""A base class for higher-order operators that invoke one subgraph and survive until codegen; the hook tracer (a symbolic interpreter of CPython 3.11/3.12 bytecode turning a hook into an FX graph, a replay plan, guards and a fingerprint); the passes that place saved-tensor pack/unpack subgraphs where they save memory; backward hooks on intermediate tensors."""

__version__ = "0.1.0"

__all__ = ["__version__"]
