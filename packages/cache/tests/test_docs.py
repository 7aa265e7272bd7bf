"""The doc page lists every bypass kind."""

from __future__ import annotations

from pathlib import Path

from loom_cache import CacheBypassKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "cache.md"


def test_every_bypass_kind_is_documented() -> None:
    text = DOC.read_text()
    missing = [k.name for k in CacheBypassKind if f"`{k.name}`" not in text]
    assert not missing, f"docs/cache.md lacks {missing}"


def test_every_cache_variable_is_documented() -> None:
    from loom_cache._config import VARIABLES

    text = DOC.read_text()
    missing = [v for v in VARIABLES if f"| `{v}` |" not in text]
    assert not missing, f"docs/cache.md's configuration table lacks {missing}"
