"""``torchloom cache``: inspect loom's compile cache.

torchloom cache stats             entries, bytes, hit rate, signing and remote tier
torchloom cache list              one line per entry, most recently used first
torchloom cache show DIGEST       an entry's key components
torchloom cache explain [DIGEST]  why a recorded miss missed (vs the nearest entry)
torchloom cache clear [--yes]     remove every entry, locally and remotely; asks first
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """Run ``torchloom cache ARGV``; the store is the cache settings' (``TORCHLOOM_CACHE_DIR``,
    ``TORCHLOOM_REMOTE_CACHE``, ...) unless ``--dir``. ``stats``, ``list`` and ``clear``
    import no torch (they read files); ``show`` and ``explain`` may."""
    import loom_cache

    return loom_cache.cache_main(argv)
