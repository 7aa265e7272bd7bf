"""The README example runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_replays_the_append() -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    assert namespace["LOG"] == [{"loss": namespace["loss_tensor"]}]
