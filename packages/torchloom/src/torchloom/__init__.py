"""torchloom: a ``torch.compile`` backend, ``torch.compile(model, backend="loom")``.

It owns everything after Dynamo: AOTAutograd with its own partition step and
compilers, the torchloom packages' passes (hooks, storage resizing, CUDA
graphs, cache) as steps of one pipeline (:class:`Pipeline`), codegen per
graph, and the runtime. :func:`capture_step` captures a whole training step as
one CUDA graph.

>>> import torch, torchloom
>>> f = torch.compile(lambda x: x.sin() * 2, backend="loom")
>>> torchloom.reset(); y = f(torch.randn(4)); print(torchloom.report())  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562), so `import torchloom` and the
# `torchloom` command start without torch, Dynamo or Inductor; the backend is
# registered through the `torch_dynamo_backends` entry point, not by import.
# torchloom._release warns once on a torch outside the tested range: at import
# when torch is already imported (the backend's case), else with the first name
# loaded (and torchloom._backend, the entry point, imports it too).
if TYPE_CHECKING:
    from loom_hops import grad_hook
    from loom_step import (
        CapturedStep,
        CaptureStepError,
        StepOptions,
        StepRefusalKind,
        StepState,
        StepStats,
        StepUnsupported,
    )
    from torchloom._api import reset
    from torchloom._backend import loom_backend
    from torchloom._capture_step import capture_step
    from torchloom._cudagraph import cudagraph_stats
    from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
    from torchloom._options import MODES, LoomOptions, LoomOptionsError, resolve_options
    from torchloom._pipeline import Pipeline
    from torchloom._report import (
        GraphRecord,
        InputMeta,
        Report,
        ReportEntry,
        StageRecord,
        report,
    )
    from torchloom._values import GraphKind

_LAZY = {
    "grad_hook": "loom_hops",
    "reset": "torchloom._api",
    "loom_backend": "torchloom._backend",
    **dict.fromkeys(
        (
            "CapturedStep",
            "CaptureStepError",
            "StepOptions",
            "StepRefusalKind",
            "StepState",
            "StepStats",
            "StepUnsupported",
        ),
        "loom_step",
    ),
    "capture_step": "torchloom._capture_step",
    "cudagraph_stats": "torchloom._cudagraph",
    **dict.fromkeys(("LoomRefusal", "RefusalKind", "Unsupported"), "torchloom._errors"),
    **dict.fromkeys(
        ("MODES", "LoomOptions", "LoomOptionsError", "resolve_options"), "torchloom._options"
    ),
    "Pipeline": "torchloom._pipeline",
    **dict.fromkeys(
        ("GraphRecord", "InputMeta", "Report", "ReportEntry", "StageRecord", "report"),
        "torchloom._report",
    ),
    "GraphKind": "torchloom._values",
}


if "torch" in sys.modules:
    importlib.import_module("torchloom._release")


# NOTE: type checkers see only the imports above, so an unknown name imported from
# this package is an error there, not an ``Any``.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            importlib.import_module("torchloom._release")
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        if name.startswith("_") and not name.startswith("__"):
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError:
                pass
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "MODES",
    "CaptureStepError",
    "CapturedStep",
    "GraphKind",
    "GraphRecord",
    "InputMeta",
    "LoomOptions",
    "LoomOptionsError",
    "LoomRefusal",
    "Pipeline",
    "RefusalKind",
    "Report",
    "ReportEntry",
    "StageRecord",
    "StepOptions",
    "StepRefusalKind",
    "StepState",
    "StepStats",
    "StepUnsupported",
    "Unsupported",
    "__version__",
    "capture_step",
    "cudagraph_stats",
    "grad_hook",
    "loom_backend",
    "report",
    "reset",
    "resolve_options",
]
