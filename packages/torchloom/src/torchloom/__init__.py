"""The `loom` backend for `torch.compile`, the pipeline that composes the torchloom packages, typed options, runtime wrappers, `torchloom.report()` and the `torchloom` command line."""

__version__ = "0.1.0"

__all__ = ["__version__"]
