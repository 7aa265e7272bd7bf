"""The cache's environment variables, validated where they are read.

A bad value never fails a compile and never passes silently: it is logged as
a WARNING naming the variable and the value, and the default is used. URLs
reach messages only through :func:`redact_url`, so a password never appears
in a log line or an error.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Final
from urllib.parse import unquote

log = logging.getLogger("torchloom.cache")

DEFAULT_MAX_BYTES: Final = 2 << 30
DEFAULT_TIMEOUT_S: Final = 0.5
_UNITS: Final = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE: Final = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)
_NETLOC_PASSWORD: Final = re.compile(r"(//[^/@:]*:)([^/@]*)(@)")


def parse_size(text: str) -> int:
    """A byte count: a plain integer, or one with a binary suffix.

    ``K``/``M``/``G``/``T`` (also ``KiB``, ``KB``, any case) multiply by powers of 1024.
    Fractions, exponents (``1e9``) and negative numbers are refused.

    >>> parse_size("512M"), parse_size("1GiB"), parse_size("100")
    (536870912, 1073741824, 100)
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size (an integer, optionally with K, M, G or T: 512M, 1G)"
        )
    return int(match.group(1)) << (10 * _UNITS[(match.group(2) or "").upper()])


def max_bytes_from_env() -> int:
    """``TORCHLOOM_CACHE_MAX_BYTES`` (default 2 GiB). ``0`` means the local tier
    stores nothing (it still serves what it holds), said once with a warning."""
    raw = os.environ.get("TORCHLOOM_CACHE_MAX_BYTES", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = parse_size(raw)
    except ValueError as exc:
        log.warning(
            "loom cache: ignoring TORCHLOOM_CACHE_MAX_BYTES=%r: %s; using the default %d bytes",
            raw,
            exc,
            DEFAULT_MAX_BYTES,
        )
        return DEFAULT_MAX_BYTES
    if value == 0:
        log.warning("loom cache: TORCHLOOM_CACHE_MAX_BYTES=0: the local tier stores nothing")
    return value


def timeout_from_env() -> float:
    """``TORCHLOOM_REMOTE_CACHE_TIMEOUT``: a positive, finite number of seconds (default 0.5)."""
    raw = os.environ.get("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        log.warning(
            "loom cache: ignoring TORCHLOOM_REMOTE_CACHE_TIMEOUT=%r: not a positive number of "
            "seconds; using the default %s s",
            raw,
            DEFAULT_TIMEOUT_S,
        )
        return DEFAULT_TIMEOUT_S
    return value


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``.

    >>> redact_url("redis://user:secret@host:6379/0")
    'redis://user:***@host:6379/0'
    """
    return _NETLOC_PASSWORD.sub(r"\1***\3", url)


def redact(text: str, url: str) -> str:
    """``text`` (say, an exception's message) with ``url``'s password, as written
    or percent-decoded, replaced by ``***``."""
    match = _NETLOC_PASSWORD.search(url)
    if match is None or not match.group(2):
        return text
    for secret in {match.group(2), unquote(match.group(2))}:
        text = text.replace(secret, "***")
    return text
