"""The package's doc page lists every refusal kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom_cells import CellRefusalKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "cells.md"


@pytest.mark.parametrize("kind", list(CellRefusalKind), ids=lambda k: k.name)
def test_every_refusal_kind_is_documented(kind: CellRefusalKind) -> None:
    assert f"`{kind.name}`" in DOC.read_text()
