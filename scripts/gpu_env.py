"""Make the workspace packages importable against a preinstalled torch.

On the GPU machine torch is preinstalled and nothing can be fetched, so the
packages are not installed: their ``src`` folders go on ``PYTHONPATH``. What an
install would add beside the code is the packages' metadata, and the umbrella
needs one piece of it: the ``torch_dynamo_backends`` entry point that lets
``torch.compile(backend="loom")`` find the backend without importing
torchloom first. This script writes minimal ``.dist-info`` folders (name,
version, entry points read from each ``pyproject.toml``) into the folder given
as its argument, which goes on ``PYTHONPATH`` too.

    python scripts/gpu_env.py /tmp/loom-site
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_dist_info(site: Path) -> list[str]:
    names = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        name, version = project["name"], project["version"]
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        groups = dict(project.get("entry-points", {}))
        if "scripts" in project:
            groups["console_scripts"] = project["scripts"]
        lines = []
        for group, entries in groups.items():
            lines.append(f"[{group}]")
            lines += [f"{k} = {v}" for k, v in entries.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        names.append(name)
    return names


if __name__ == "__main__":
    site = Path(sys.argv[1])
    print("dist-info written for:", ", ".join(write_dist_info(site)))
