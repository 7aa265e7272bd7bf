import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loom_cudagraph import reset_skip_counts

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_skip_counts() -> Iterator[None]:
    reset_skip_counts()
    yield
    reset_skip_counts()
