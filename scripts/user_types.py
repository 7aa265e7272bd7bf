"""User code under ``mypy --strict``, as a user of the installed packages writes it.

For each package: a file importing every name of its ``__all__`` plus one that does
not exist (which must be the file's one error: a lazy ``__getattr__`` must not turn it
into an ``Any``); a file passing a plain ``def`` where a hook is expected; every
README example. Run by the ``packages`` nox session against the environment that
holds every package's wheel:

    python scripts/user_types.py PYTHON_EXECUTABLE WORKDIR

Exits 1, printing mypy's output, when an expected error is missing or another appears.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING = "NoSuchName"
HOOKS = """\
from loom_cells import CellModel, FrameCells
from loom_sidefx import Roots, SideEffects


def hook(x: int) -> int:
    return x + 1


roots = Roots.of(hook, (1,))
frame = FrameCells.for_hook(CellModel(SideEffects()), hook)
"""
#: Names a strict user file may not call without annotations of its own: torch's
#: (``Tensor.backward`` has none), not the packages'.
MYPY = ("--strict", "--untyped-calls-exclude=torch", "--no-incremental")


def public_names(init: Path) -> list[str]:
    """The ``__all__`` of a package's ``__init__.py``, read without importing it."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError(f"{init}: no __all__")


def write_user_files(out: Path) -> dict[str, str]:
    """The user files; returns each module's expected error line."""
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    inits = sorted(ROOT.glob("packages/*/src/*/__init__.py"))
    for init in [*inits, ROOT / "packages/torchloom/src/torchloom/trainers.py"]:
        module = init.parent.name if init.name == "__init__.py" else f"torchloom.{init.stem}"
        names = [n for n in public_names(init) if n != "__version__"]
        lines = [f"from {module} import {name}" for name in [*names, MISSING]]
        user = f"user_{module.replace('.', '_')}.py"
        (out / user).write_text("\n".join(lines) + "\n")
        expected[module] = (
            f'{user}:{len(lines)}: error: Module "{module}" has no attribute "{MISSING}"'
        )

    (out / "user_hooks.py").write_text(HOOKS)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "readme_examples.py"),
            "write",
            *map(str, sorted(ROOT.glob("packages/*/README.md"))),
            str(out),
        ],
        check=True,
    )
    return expected


def main(python: str, work: Path) -> int:
    python = os.path.abspath(python)  # a venv's python is a link: not resolved
    files = work / "user"
    expected = write_user_files(files)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            *MYPY,
            "--python-executable",
            python,
            "--cache-dir",
            str(work / "mypy-cache"),
            ".",
        ],
        cwd=files,
        capture_output=True,
        text=True,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    missing = [e for e in expected.values() if not any(line.startswith(e) for line in errors)]
    unexpected = [line for line in errors if not any(line.startswith(e) for e in expected.values())]
    checked = len(list(files.glob("*.py")))
    print(f"mypy --strict on {checked} user files: {len(errors)} errors, {len(expected)} expected")
    if missing or unexpected or proc.returncode not in (0, 1):
        print(proc.stdout, proc.stderr, sep="\n")
        print("expected but missing:", *missing, "unexpected:", *unexpected, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
