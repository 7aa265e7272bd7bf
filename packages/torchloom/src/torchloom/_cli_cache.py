"""``torchloom cache``: inspect loom's compile cache.

torchloom cache stats             entries, bytes, hit rate
torchloom cache list              one line per entry, most recently used first
torchloom cache show DIGEST       an entry's key components
torchloom cache explain [DIGEST]  why a recorded miss missed (vs the nearest entry)
torchloom cache clear             remove every entry
"""

from __future__ import annotations

from collections.abc import Sequence

import loom_cache

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """Run ``torchloom cache ARGV``; the store is ``TORCHLOOM_CACHE_DIR`` unless ``--dir``."""
    return loom_cache.cache_main(argv)
