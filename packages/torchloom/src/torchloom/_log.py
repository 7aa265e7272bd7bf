"""Logging for torchloom: ``logging.getLogger("torchloom.<area>")``.

``TORCHLOOM_LOG=debug`` (or ``info``) attaches a stderr handler to the
``torchloom`` logger at that level; at ``debug`` each stage prints its graphs.
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure_logging", "get_logger"]

_configured = False


def get_logger(area: str) -> logging.Logger:
    configure_logging()
    return logging.getLogger(f"torchloom.{area}")


def configure_logging() -> None:
    """Apply ``TORCHLOOM_LOG`` once per process."""
    global _configured
    if _configured:
        return
    _configured = True
    level = os.environ.get("TORCHLOOM_LOG", "").strip().upper()
    if not level:
        return
    numeric = logging.getLevelName(level)
    if not isinstance(numeric, int):
        logging.getLogger("torchloom").warning("TORCHLOOM_LOG=%r is not a logging level", level)
        return
    root = logging.getLogger("torchloom")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(numeric)
