"""Private torch APIs stay in _torch_compat.py; every refusal kind is documented."""

from __future__ import annotations

import re
from pathlib import Path

from loom_hops import HopsRefusalKind

SRC = Path(__file__).parents[1] / "src" / "loom_hops"
DOC = Path(__file__).parents[3] / "docs" / "hops.md"


def test_private_torch_apis_only_in_the_compat_module() -> None:
    offenders = []
    for path in SRC.glob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\._(?!_)", line):
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_every_refusal_kind_is_in_the_doc_page() -> None:
    text = DOC.read_text()
    missing = [k.name for k in HopsRefusalKind if f"`{k.value}`" not in text]
    assert not missing, missing
