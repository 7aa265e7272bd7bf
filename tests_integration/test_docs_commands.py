"""The shell commands of README.md and docs/*.md work as written.

A command is a line of a fenced ``bash``/``sh``/``shell``/``console`` block, of an
indented block that starts with a known program (``uv run``, ``python``, ``bash``,
``torchrun``, ...), with backslash continuations joined and ``# ...`` lines dropped, or
a code span in prose that starts with ``uv run``, ``python`` or ``.venv/bin/python``.
Every command is checked without running it:

- every repository path it names exists;
- every ``--option`` it gives a repository script is one that script, or a module in
  its folder (the shared benchmark harness, ``scripts/dist_configs``), defines;
- a ``python -c`` snippet that imports the project's packages runs through the
  project's environment (``uv run`` or ``.venv/bin/python``): a bare ``python`` has none
  of them (issue 47: ``docs/torchloom.md``'s command failed as written).

A ``pytest`` command that is not a GPU command (no ``--device cuda``, ``torchrun``,
``gpu_tier``) is collected as written, and must select no ``gpu``-marked test: on a CPU
machine such a test fails ("a gpu-marked test ran without CUDA"; issue 47:
``docs/testing.md``'s corpus command exited 1).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("uv run", "python", "python3", ".venv/bin/python", "bash", "torchrun", "torchloom")
SHELL_FENCES = {"bash", "sh", "shell", "console"}
GPU_MARKS = ("--device cuda", "torchrun", "torch.distributed.run", "gpu_tier", "CUDA_VISIBLE")
REPO_PATH = re.compile(r"\b((?:packages|benchmarks|scripts|tests_integration|docs)/[\w./-]+)")
PACKAGE_IMPORT = re.compile(r"\b(?:import|from)\s+(torchloom|loom_\w+)")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
#: A command quoted in prose: `uv run ...`, `python -c "..."`, `.venv/bin/python ...`.
INLINE = re.compile(r"`((?:uv run|python3?|\.venv/bin/python) [^`]+)`")


def _commands(page: Path) -> list[tuple[str, int, str]]:
    """(page name, line number, command) for every shell command of ``page``."""
    found: list[tuple[str, int, str]] = []
    lines = page.read_text().splitlines()
    fence: str | None = None
    pending: list[str] = []
    prose: list[tuple[int, str]] = []  # a code span may wrap onto the next line
    start = 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        in_shell = fence in SHELL_FENCES
        indented = (
            fence is None and line.startswith("    ") and (pending or stripped.startswith(PROGRAMS))
        )
        if fence is None and not indented:
            prose.append((number, line))
        if not (in_shell or indented) or not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        pending.append(stripped.rstrip("\\").strip())
        if not stripped.endswith("\\"):
            found.append((page.name, start, " ".join(pending)))
            pending = []
    text, offsets = "", []
    for number, line in prose:
        offsets.append((len(text), number))
        text += line + " "
    for match in INLINE.finditer(text):
        number = max(n for at, n in offsets if at <= match.start())
        found.append((page.name, number, match.group(1)))
    return found


ALL = [c for page in PAGES for c in _commands(page)]


def _words(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words


def test_the_pages_have_commands() -> None:
    pages = {page for page, _, _ in ALL}
    assert {"README.md", "testing.md"} <= pages, pages


@pytest.mark.parametrize(("page", "line", "command"), ALL, ids=[f"{p}:{n}" for p, n, _ in ALL])
def test_a_command_names_paths_and_options_that_exist(page: str, line: int, command: str) -> None:
    words = _words(command)
    for match in REPO_PATH.finditer(command):
        path = match.group(1).split("::")[0].rstrip(".,;:)")
        if any(ch in path for ch in "*{$"):
            continue
        assert (REPO / path).exists(), f"{page}:{line}: {path} does not exist: {command}"
    scripts = [w for w in words if w.endswith(".py") and (REPO / w).is_file()]
    if scripts and "pytest" not in words:
        # NOTE: a script may take its parser from a module beside it (dist_configs/common.py)
        folder = (REPO / scripts[0]).parent
        source = "".join(p.read_text() for p in sorted(folder.rglob("*.py")))
        after = words[words.index(scripts[0]) + 1 :]
        for option in (w.split("=")[0] for w in after if w.startswith("--")):
            assert f'"{option}"' in source, f"{page}:{line}: {scripts[0]} has no {option}"
    if "-c" in words and words[0] in ("python", "python3"):
        snippet = words[words.index("-c") + 1] if words.index("-c") + 1 < len(words) else ""
        assert not PACKAGE_IMPORT.search(snippet), (
            f"{page}:{line}: a bare {words[0]} has none of the project's packages: "
            f"write `uv run python -c ...` ({command})"
        )


PYTEST = [
    c
    for c in ALL
    if "pytest" in c[2] and not any(mark in c[2] for mark in GPU_MARKS) and "--collect" not in c[2]
]


@pytest.mark.parametrize(
    ("page", "line", "command"), PYTEST, ids=[f"{p}:{n}" for p, n, _ in PYTEST]
)
def test_a_cpu_pytest_command_selects_no_gpu_test(page: str, line: int, command: str) -> None:
    words = _words(command)
    # NOTE: one -q, so the collection lists node ids (-qq prints counts per file).
    args = [w for w in words[words.index("pytest") + 1 :] if w not in ("-q", "-qq")]
    marks = "gpu"
    if "-m" in args:
        at = args.index("-m")
        expression = args[at + 1]
        if re.fullmatch(r"not gpu( and [\w ]+)?", expression) and " or " not in expression:
            return  # "not gpu" is one of its and-ed terms: no gpu test can be selected
        marks = f"({expression}) and gpu"
        args = args[:at] + args[at + 2 :]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            "-m",
            marks,
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    selected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert not selected, (
        f"{page}:{line}: `{command}` selects gpu-marked tests, which fail on a CPU machine "
        f'(add -m "not gpu"): {selected[:3]}'
    )
