"""FX passes that functionalize `untyped_storage().resize_()` on graph inputs the way FSDP2 uses it, remove the `resize_(full) -> copy_ -> resize_(0)` chain, keep `fsdp.copy_` alias semantics, and refuse what cannot be functionalized soundly."""

__version__ = "0.1.0"

__all__ = ["__version__"]
