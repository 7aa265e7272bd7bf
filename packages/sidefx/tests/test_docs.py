"""The package's doc page lists every refusal kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom_sidefx import SideEffectRefusalKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "sidefx.md"


@pytest.mark.parametrize("kind", list(SideEffectRefusalKind), ids=lambda k: k.name)
def test_every_refusal_kind_is_documented(kind: SideEffectRefusalKind) -> None:
    assert f"`{kind.name}`" in DOC.read_text()
