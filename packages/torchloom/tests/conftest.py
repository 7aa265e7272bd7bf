"""Every umbrella test compiles against its own empty loom cache, so a test never
gets a hit from an earlier test or an earlier run (the cache is on by default).
The folder is importable for the tests' shared helpers (``_train``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _private_loom_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "loom-cache"))
    monkeypatch.delenv("TORCHLOOM_REMOTE_CACHE", raising=False)
    yield
