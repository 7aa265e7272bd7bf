"""Rules the whole tree keeps: typed facades, private torch APIs behind one
compat module per package, Python-version checks behind one module, and
import boundaries between packages."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "sidefx": "loom_sidefx",
    "cells": "loom_cells",
    "hops": "loom_hops",
    "resize": "loom_resize",
    "cudagraph": "loom_cudagraph",
    "cache": "loom_cache",
    "torchloom": "torchloom",
}
# Files allowed to name private torch APIs or check the Python version.
COMPAT_FILES = {"_torch_compat.py", "_pyversion.py"}
SNAPSHOT_DIR = ROOT / "tests_integration" / "api"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / "packages" / folder / "src").rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_private_torch_apis_only_in_compat_module(folder: str) -> None:
    offenders = []
    for path in _sources(folder):
        if path.name in COMPAT_FILES:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
                base = node.value
                if isinstance(base, ast.Name) and base.id == "torch" and _private(name):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{name}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                if re.match(r"(torch|functorch)(\.|$)", node.module) and any(
                    _private(part) for part in node.module.split(".")
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch") and any(
                        _private(p) for p in alias.name.split(".")
                    ):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}")
    assert not offenders, "private torch APIs outside _torch_compat.py:\n" + "\n".join(offenders)


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_python_version_checks_only_in_pyversion_module(folder: str) -> None:
    offenders = [
        f"{p.relative_to(ROOT)}"
        for p in _sources(folder)
        if p.name not in COMPAT_FILES and "sys.version_info" in p.read_text()
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("folder,module", sorted(PACKAGES.items()))
def test_package_is_typed_and_declares_all(folder: str, module: str) -> None:
    src = ROOT / "packages" / folder / "src" / module
    assert (src / "py.typed").exists()
    mod = importlib.import_module(module)
    assert isinstance(mod.__version__, str)
    assert "__version__" in mod.__all__
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name!r}"


def _api_snapshot(module: str) -> str:
    mod = importlib.import_module(module)
    lines = []
    for name in sorted(mod.__all__):
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            lines.append(f"class {name}")
        elif callable(obj):
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            lines.append(f"def {name}{sig}")
        else:
            lines.append(f"{name}: {type(obj).__name__}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("module", sorted(PACKAGES.values()))
def test_public_api_matches_snapshot(module: str) -> None:
    """An API change is a visible diff: LOOM_UPDATE_SNAPSHOTS=1 rewrites the file."""
    path = SNAPSHOT_DIR / f"{module}.txt"
    got = _api_snapshot(module)
    if os.environ.get("LOOM_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT_DIR.mkdir(exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"no API snapshot for {module}: run with LOOM_UPDATE_SNAPSHOTS=1"
    assert got == path.read_text(), (
        f"{module}'s public API changed; review, then rerun with LOOM_UPDATE_SNAPSHOTS=1"
    )


@pytest.mark.parametrize("module", ["loom_sidefx", "loom_cells"])
def test_pure_packages_never_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
