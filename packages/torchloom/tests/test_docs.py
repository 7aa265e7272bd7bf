"""The docs list every refusal kind and every option."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchloom import LoomOptions, RefusalKind

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_every_umbrella_refusal_kind_is_documented() -> None:
    text = (DOCS / "unsupported.md").read_text()
    missing = [k.name for k in RefusalKind if f"`{k.name}`" not in text]
    assert not missing, f"docs/unsupported.md lacks {missing}"


def test_every_option_is_in_the_readme_table() -> None:
    text = (DOCS.parent / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(LoomOptions) if f"`{f.name}`" not in text]
    assert not missing, f"README.md options table lacks {missing}: add a row for each"
