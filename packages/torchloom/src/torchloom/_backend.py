"""The ``loom`` backend as ``torch.compile`` calls it.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="loom")`` works in a fresh interpreter without
importing torchloom first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.fx import GraphModule

import torchloom._release  # noqa: F401  (the entry point: warns once on an untested torch)
from torchloom._cudagraph import release_graphs
from torchloom._pipeline import DEFAULT_PIPELINE

__all__ = ["loom_backend"]


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
