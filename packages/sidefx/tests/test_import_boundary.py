"""loom_sidefx is pure Python: importing it never pulls in torch."""

import subprocess
import sys


def test_import_does_not_load_torch() -> None:
    code = "import sys, loom_sidefx; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
