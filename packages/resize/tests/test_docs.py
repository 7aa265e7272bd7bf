"""docs/resize.md documents every refusal and left-alone kind."""

from __future__ import annotations

from pathlib import Path

from loom_resize import ResizeRefusalKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "resize.md"


def test_every_resize_kind_is_documented() -> None:
    text = DOC.read_text()
    missing = [k.name for k in ResizeRefusalKind if f"`{k.name}`" not in text]
    assert not missing, f"docs/resize.md lacks {missing}"
