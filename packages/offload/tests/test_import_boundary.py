"""loom_offload imports nothing of the umbrella package or of loom_hops."""

import subprocess
import sys


def test_import_does_not_load_umbrella_or_hops() -> None:
    code = (
        "import sys, loom_offload; "
        "assert 'torchloom' not in sys.modules and 'loom_hops' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
