"""docs/cudagraph.md lists every skip reason and every public name."""

from __future__ import annotations

from pathlib import Path

import loom_cudagraph
from loom_cudagraph import CudagraphRefusalKind

DOC = Path(__file__).resolve().parents[3] / "docs" / "cudagraph.md"


def test_every_skip_reason_is_documented() -> None:
    text = DOC.read_text()
    missing = [k.name for k in CudagraphRefusalKind if f"`{k.name}`" not in text]
    assert not missing, f"add these CudagraphRefusalKind kinds to docs/cudagraph.md: {missing}"


def test_main_api_is_documented() -> None:
    text = DOC.read_text()
    for name in ("plan_graph", "build_runtime", "mark_non_capturable", "new_pool", "HostCapturer"):
        assert name in loom_cudagraph.__all__
        assert f"`{name}" in text, name
