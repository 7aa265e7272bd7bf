"""The CUDA-graph partition plan (which nodes can be captured, and typed reasons for those that cannot), the capture/replay runtime (static inputs, re-recording budget, input mutation, output lifetime, memory pool, dynamic shapes) and `or_error` mode."""

__version__ = "0.1.0"

__all__ = ["__version__"]
