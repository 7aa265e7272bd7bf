"""The ``loom`` backend as ``torch.compile`` calls it.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="loom")`` works in a fresh interpreter without
importing torchloom first. ``torch.compile()`` imports this module (the backend's
lookup); on a machine with CUDA it also imports Inductor's runtime there, as
``backend="inductor"`` does (:func:`import_codegen_runtime`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

import torchloom._release  # noqa: F401  (the entry point: warns once on an untested torch)
from torchloom import _torch_compat as compat
from torchloom._cudagraph import release_graphs
from torchloom._options import LoomOptionsError, resolve_options
from torchloom._pipeline import DEFAULT_PIPELINE

__all__ = ["import_codegen_runtime", "loom_backend"]


def loom_backend(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """``torch.compile(model, backend="loom", mode=..., options={...})``.

    >>> compiled = torch.compile(model, backend="loom", options={"codegen": "eager"})
    """
    return DEFAULT_PIPELINE(gm, example_inputs, mode=mode, options=options)


# NOTE: ``torch._dynamo.reset()`` calls ``reset()`` on each backend it used (as
# it resets Inductor's CUDA graph trees): loom drops its captured CUDA graphs
# there, or the pools of every function Dynamo compiled would live as long as
# the compiled functions, which Dynamo keeps as globals of the user's modules.
loom_backend.reset = release_graphs  # type: ignore[attr-defined]


def import_codegen_runtime() -> bool:
    """At ``torch.compile()``: import the runtime that Inductor's generated modules
    load, where ``torch.compile(backend="inductor")`` imports it, on a machine with CUDA
    when the environment's options leave Inductor as the codegen (the default).
    Returns whether it did.

    Without it, a warm start paid that import (Inductor's lowering and Triton's
    codegen, 0.5-0.9 s on an H100 or H200 host) inside its first call, where
    ``backend="inductor"`` had paid it before, at ``torch.compile()``. A CPU-only
    machine keeps the import at the first generated module's load: there most
    compilations use eager codegen (``options={"codegen": "eager"}``, which the
    lookup cannot see), and the import would cost every one of them.
    """
    if not torch.cuda.is_available():
        return False
    try:
        codegen = resolve_options(None, None).codegen
    except LoomOptionsError:  # the compilation itself reports it
        return False
    if codegen != "inductor":
        return False
    compat.import_inductor_runtime()
    return True


import_codegen_runtime()
