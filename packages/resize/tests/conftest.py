"""Makes ``resize_testing`` importable and provides a fresh recorder per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resize_testing import Recorder


@pytest.fixture
def recorder() -> Recorder:
    torch._dynamo.reset()
    return Recorder()
