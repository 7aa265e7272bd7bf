"""The tracer depends on loom_sidefx, loom_cells and torch only: importing it loads
neither loom_hops (its one user in the workspace) nor the umbrella."""

import subprocess
import sys


def test_import_loads_neither_hops_nor_the_umbrella() -> None:
    code = (
        "import sys, loom_tracer; "
        "assert not {'loom_hops', 'torchloom'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
