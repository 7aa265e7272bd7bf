"""The Python examples of a README (or any Markdown page): find them, run them, type-check them.

A fenced ```` ```python ```` block is an example. The HTML comment on the line before
its fence says what it needs beyond its own package, e.g. ``<!-- example: gpu -->``
(a CUDA device: skipped without one, with a CPU form beside it) or
``<!-- example: needs torchloom -->`` (runs where that distribution is installed);
``<!-- example: fragment -->`` marks a block that only shows calls (names it does not
define), checked for syntax only. Every other block runs as written, as its own
script in a fresh process, from a scratch folder, with loom's cache in it.

Used by ``packages/*/tests/test_readme.py``-style tests and by the ``packages`` nox
session, which runs it in each package's own virtual environment (only the standard
library here: that environment holds the package and its declared dependencies).

    python scripts/readme_examples.py run packages/resize/README.md
    python scripts/readme_examples.py run-needing packages/hops/README.md
    python scripts/readme_examples.py write packages/resize/README.md OUTDIR
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Example", "examples", "missing_needs", "run_example"]

_BLOCK = re.compile(
    r"(?:^<!--\s*example:\s*(?P<marks>[^>]*?)\s*-->\n)?^```python\n(?P<code>.*?)^```",
    re.S | re.M,
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One fenced Python block: where it is, what it needs, its code."""

    page: Path
    line: int
    code: str
    gpu: bool = False
    fragment: bool = False
    needs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def examples(page: Path) -> list[Example]:
    """Every ```` ```python ```` block of ``page``, in order, with its marks."""
    text = page.read_text()
    found = []
    for match in _BLOCK.finditer(text):
        marks = (match.group("marks") or "").split()
        unknown = (
            set(marks)
            - {"gpu", "fragment", "needs"}
            - set(marks[marks.index("needs") + 1 :] if "needs" in marks else ())
        )
        if unknown:
            raise ValueError(f"{page}: unknown example mark(s) {sorted(unknown)}")
        needs = tuple(marks[marks.index("needs") + 1 :]) if "needs" in marks else ()
        line = text.count("\n", 0, match.start("code")) + 1
        found.append(
            Example(page, line, match.group("code"), "gpu" in marks, "fragment" in marks, needs)
        )
    return found


def missing_needs(example: Example) -> list[str]:
    """What ``example`` needs that this environment lacks ("a CUDA device", module names)."""
    missing = [name for name in example.needs if importlib.util.find_spec(name) is None]
    if example.gpu and not _has_cuda():
        missing.append("a CUDA device")
    return missing


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def run_example(example: Example, python: str = sys.executable, timeout: float = 600) -> str:
    """Run ``example`` as its own script; its output, or ``AssertionError`` with the failure."""
    ast.parse(example.code, filename=example.name)
    if example.fragment:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(example.code)
        env = {**os.environ, "TORCHLOOM_CACHE_DIR": str(Path(tmp) / "cache")}
        proc = subprocess.run(
            [python, str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
        )
    if proc.returncode != 0:
        raise AssertionError(
            f"{example.page}:{example.line}: the example exited {proc.returncode}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def _run(page: Path, needs_only: bool = False) -> int:
    failed = 0
    for example in examples(page):
        if needs_only and not example.needs:
            continue
        missing = missing_needs(example)
        if missing:
            print(f"{example.name}: skipped, needs {', '.join(missing)}", flush=True)
            continue
        start = time.monotonic()
        try:
            run_example(example)
        except AssertionError as error:
            print(error, flush=True)
            failed += 1
            continue
        kind = "syntax checked" if example.fragment else "ran"
        print(f"{example.name}: {kind} ({time.monotonic() - start:.1f} s)", flush=True)
    return failed


def _write(page: Path, out: Path) -> None:
    """Each runnable example as ``<stem>_<line>.py`` in ``out`` (for mypy)."""
    out.mkdir(parents=True, exist_ok=True)
    for example in examples(page):
        if not example.fragment:
            stem = re.sub(r"\W", "_", f"{page.parent.name}_{page.stem}_{example.line}")
            (out / f"{stem}.py").write_text(example.code)


if __name__ == "__main__":
    command, *pages = sys.argv[1:]
    if command in ("run", "run-needing"):
        # run-needing: only the blocks that need another package (the umbrella's
        # environment runs the other packages' blocks marked ``needs torchloom``)
        failed = sum(_run(Path(p), command == "run-needing") for p in pages)
        sys.exit(1 if failed else 0)
    if command == "write":
        *pages, outdir = pages
        for p in pages:
            _write(Path(p), Path(outdir))
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} run|run-needing PAGE... | write PAGE... OUTDIR")
