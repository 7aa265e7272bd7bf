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

import torchloom._release  # noqa: F401  (first: warns on a torch outside the tested range)
from loom_hops import grad_hook
from torchloom._api import reset
from torchloom._backend import loom_backend
from torchloom._capture_step import CapturedStep, StepStats, capture_step
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
from torchloom._step_refusals import CaptureStepError, StepRefusal, StepUnsupported
from torchloom._values import GraphKind

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
    "StepRefusal",
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
