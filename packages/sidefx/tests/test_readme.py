"""The README example runs as written (with the hook it describes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_replays_the_append() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict[str, Any] = {"LOG": [], "args": (), "loss_tensor": "T"}
    exec("def hook():\n    LOG.append({'loss': None})\n", namespace)
    exec(code, namespace)
    assert namespace["LOG"] == [{"loss": "T"}]
