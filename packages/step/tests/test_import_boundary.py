"""loom_step imports nothing of the umbrella package."""

import subprocess
import sys


def test_import_does_not_load_umbrella() -> None:
    code = "import sys, loom_step; assert 'torchloom' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
