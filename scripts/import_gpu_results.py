"""Append benchmark tables measured on the GPU machine to benchmarks/results/.

The GPU script (``scripts/gpu_tier.sh``) runs each benchmark with
``BENCH_OUT`` set, so every table is also written as ``$BENCH_OUT/<name>.json``;
those files come back from the device machine. This script appends each entry
to ``benchmarks/results/<name>.md``, skipping entries already there.

    python scripts/import_gpu_results.py DIR_WITH_JSON_FILES
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import RESULTS_DIR, write_entry  # noqa: E402


def main(folder: Path) -> None:
    for path in sorted(folder.glob("*.json")):
        name = path.stem
        existing = RESULTS_DIR / f"{name}.md"
        text = existing.read_text() if existing.exists() else ""
        for e in json.loads(path.read_text()):
            if f"## {e['title']} — {e['date']}" in text:
                continue
            write_entry(RESULTS_DIR, name, e["title"], e["date"], e["env"], e["notes"], e["rows"])
            print(f"appended {name}: {e['title']} ({e['date']})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
