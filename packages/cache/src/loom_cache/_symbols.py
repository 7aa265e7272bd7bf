"""Stable names for the symbols of dynamic dimensions.

A symbol is named from a hash of its source (``L['x'].size()[0]``), never
from the order in which symbols were created, so a run whose profile marks
extra dimensions dynamic (and later specializes them away) names the
surviving symbols exactly as a run that never marked them. Collisions are
resolved by linear probing in the sorted order of the sources, so the result
depends only on the *set* of sources present, not on creation order.
Symbols without a source (unbacked, data-dependent sizes) are numbered by
first appearance in the graph, which is itself canonical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Mapping
from typing import Final, TypeVar

SYMBOL_BUCKETS: Final = 1 << 20

K = TypeVar("K", bound=Hashable)


def symbol_id(source_name: str) -> int:
    """The preferred id of a symbol created from ``source_name``."""
    return int(hashlib.sha256(source_name.encode()).hexdigest(), 16) % SYMBOL_BUCKETS


def stable_symbol_names(
    sources: Mapping[K, str], unsourced: Iterable[K] = (), *, prefix: str = "s"
) -> dict[K, str]:
    """Name each symbol from its source with linear probing on collision.

    ``sources`` maps a symbol to the (first) name of its source; ``unsourced``
    lists symbols with no source in canonical (first-appearance) order.

    >>> names = stable_symbol_names({"a": "L['x'].size()[0]", "b": "L['y'].size()[1]"})
    >>> names == stable_symbol_names({"b": "L['y'].size()[1]", "a": "L['x'].size()[0]"})
    True
    """
    taken: set[int] = set()
    names: dict[K, str] = {}
    # Sorting by (source, symbol text) makes probing independent of creation order.
    for symbol, source in sorted(sources.items(), key=lambda kv: (kv[1], str(kv[0]))):
        attempt = symbol_id(source)
        while attempt in taken:
            attempt = (attempt + 1) % SYMBOL_BUCKETS
        taken.add(attempt)
        names[symbol] = f"{prefix}{attempt}"
    for index, symbol in enumerate(s for s in unsourced if s not in names):
        names[symbol] = f"u{index}"
    return names
