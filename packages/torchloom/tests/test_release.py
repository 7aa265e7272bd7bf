"""The tested torch range: a release outside it warns at import, never crashes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from torchloom import _release

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"]
)
def test_tested_releases_do_not_warn(version: str) -> None:
    assert _release.untested_torch_message(version) is None


@pytest.mark.parametrize(
    "version", ["2.10.0", "2.16.0", "2.16.0.dev20260301+cpu", "3.0.0", "nightly"]
)
def test_other_releases_get_a_message_naming_the_range(version: str) -> None:
    message = _release.untested_torch_message(version)
    assert message is not None
    assert "torch>=2.11,<2.16" in message and "2.11 to 2.15" in message
    assert f"this is torch {version}" in message
    with pytest.warns(_release.TorchReleaseWarning, match=r"torch>=2\.11,<2\.16"):
        assert _release.warn_if_untested_torch(version)


def test_the_installed_torch_is_in_the_range() -> None:
    # CI runs every release of the range; a torch outside it would mean the range is stale.
    assert _release.torch_release() in _release.TESTED_RELEASES, torch.__version__


def test_import_on_an_untested_release_warns_once_and_works() -> None:
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import torch\n"
        "from torch.torch_version import TorchVersion\n"
        "torch.__version__ = TorchVersion('2.17.0')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import torchloom\n"
        "msgs = [str(w.message) for w in caught if type(w.message).__name__ == 'TorchReleaseWarning']\n"
        "assert len(msgs) == 1 and '2.17.0' in msgs[0], msgs\n"
        "f = torch.compile(lambda x: x.sin() * 2, backend='loom', options={'codegen': 'eager'})\n"
        "x = torch.randn(3)\n"
        "torch.testing.assert_close(f(x), x.sin() * 2)\n"
        "print('ok')\n"
    )
    env = {"TORCHLOOM_CACHE": "0", "PATH": ""}
    # NOTE: the caller's bytecode settings pass through (nox keeps the compiled
    # sources in its environment; without them this process compiles torch anew).
    keep = ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")
    env.update({k: os.environ[k] for k in keep if k in os.environ})
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_package_metadata_declares_the_tested_range() -> None:
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        torch_deps = [d for d in deps if d.startswith("torch") and d.split(">")[0] == "torch"]
        assert torch_deps in ([], [_release.TESTED_RANGE]), (pyproject, torch_deps)


def test_tested_releases_are_the_ones_ci_runs() -> None:
    """The locked release, ``BETWEEN_TORCH`` and ``NEWEST_TORCH`` of ``noxfile.py``; a release
    inside the declared range that CI does not run (2.12) is not listed (issue 47)."""
    nox = (ROOT / "noxfile.py").read_text()
    between = re.search(r"BETWEEN_TORCH = \[(.*?)\]", nox)
    newest = re.search(r'NEWEST_TORCH = "(\d+\.\d+)', nox)
    assert between is not None and newest is not None
    run = {"2.11", *re.findall(r'"(\d+\.\d+)\.\d+"', between.group(1)), newest.group(1)}
    listed = {f"{major}.{minor}" for major, minor in _release.TESTED_RELEASES}
    assert listed == run
    assert _release.untested_torch_message("2.12.0") is None  # inside the range: no warning
