"""Cache keys you can explain (canonical graph fingerprints, stable symbol names, hook fingerprints, configuration and versions), artifact stores (an embedded local store, Redis for a fleet) and hit/miss explanations."""

__version__ = "0.1.0"

__all__ = ["__version__"]
