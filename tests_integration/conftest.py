"""Shared fixtures for the integration tier.

Every test starts from a clean compiler state: Dynamo's caches and counters
and torchloom's report are reset before and after it, and loom's artifact
cache points at an empty directory, so a test's graphs, recompiles and cache
misses are its own. ``tests_integration/`` is put on ``sys.path`` so tests
import the program corpus as ``loom_corpus``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def _reset_compilers() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        torchloom = importlib.import_module("torchloom")
    except ImportError:  # the umbrella is not installed in this environment
        return
    reset = getattr(torchloom, "reset", None)
    if reset is not None:
        reset()


@pytest.fixture(autouse=True)
def fresh_compiler_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    # NOTE: an empty loom cache per test, so every test compiles cold whatever
    # ran before it (and never reads ~/.cache/torchloom); a test may set its own.
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("loom-cache")))
    _reset_compilers()
    yield
    _reset_compilers()


@pytest.fixture
def cuda_without_tf32() -> Iterator[torch.device]:
    """The CUDA device with TF32 off for matmuls and convolutions, restored after."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without CUDA: run it through scripts/gpu_tier.sh")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
