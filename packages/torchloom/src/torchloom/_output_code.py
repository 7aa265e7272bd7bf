"""Loom's compiled graphs as Inductor ``OutputCode`` objects, so AOTAutograd can
bundle them into loom's cache like an Inductor result.

:class:`EagerOutputCode` is a graph run eagerly (boxed); :class:`SegmentedOutputCode`
is a graph compiled as separately generated CUDA-graph segments and run by a
runtime that a factory builds. Both pickle without their callables and rebuild
them on first use (a cache hit).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from torchloom import _torch_compat as compat

__all__ = ["EagerOutputCode", "SegmentedOutputCode"]


class EagerOutputCode(compat.OutputCode):  # type: ignore[misc]
    """A boxed eager graph as an Inductor ``OutputCode``. It runs exactly as
    ``compat.boxed_graph_callable``; pickling stores a copy of its graph with the
    standard code generator and no metadata."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__()
        # NOTE: an instance attribute: wrappers (functools.wraps) copy __dict__ only.
        compat.mark_boxed(self)
        self.gm = gm
        self._fn: Callable[[list[Any]], Any] | None = compat.boxed_graph_callable(gm)

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._fn is None:
            self._fn = compat.boxed_graph_callable(self.gm)
        return self._fn(inputs)  # type: ignore[arg-type]

    def prepare_for_serialization(self) -> None:
        pass  # __getstate__ drops the callable

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        pass

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        for node in graph.nodes:
            node.meta = {}
        return {**self.__dict__, "_fn": None, "gm": GraphModule(self.gm, graph)}


class SegmentedOutputCode(compat.OutputCode):  # type: ignore[misc]
    """A graph compiled as separately generated segments, run by a runtime that
    ``factory(self)`` builds (loom's CUDA-graph runtime).

    Pickling keeps the plan (JSON), the segments' own ``OutputCode`` objects and
    the graph's constant outputs; after loading, :meth:`post_compile` reloads
    each Inductor segment as Inductor's cache would and rebuilds the runtime.
    """

    def __init__(
        self,
        plan_json: str,
        segments: list[Any],
        output_constants: tuple[Any, ...],
        factory: Callable[[SegmentedOutputCode], Callable[[list[Any]], Any]],
        *,
        is_backward: bool,
        is_inference: bool,
        runtime: Callable[[list[Any]], Any] | None = None,
        pool: Any = None,
    ) -> None:
        super().__init__()
        compat.mark_boxed(self)
        self.plan_json = plan_json
        self.segments = segments
        self.output_constants = output_constants
        self.factory = factory
        self.is_backward = is_backward
        self.is_inference = is_inference
        self.runtime = runtime
        self.pool = pool
        self.output_strides: list[Any] = []

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self.runtime is None:
            self.runtime = self.factory(self)
        return self.runtime(inputs)  # type: ignore[arg-type]

    def prepare_for_serialization(self) -> None:
        self.segments = [copy.copy(s) for s in self.segments]
        for s in self.segments:
            if isinstance(s, compat.OutputCode):
                s.prepare_for_serialization()

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        if self.runtime is not None:
            return  # a cold compile: the segments ran their own post-compile steps
        kwargs = {
            **dict(graph_kwargs or {}),
            "cudagraphs": compat.BoxedBool(False),
            "is_backward": self.is_backward,
            "is_inference": self.is_inference,
        }
        loaded = []
        for seg in self.segments:
            reloaded = compat.reload_inductor_segment(seg, example_inputs, constants, kwargs)
            if reloaded is None:
                raise RuntimeError("could not reload a cached CUDA-graph segment")
            loaded.append(reloaded)
        self.segments = loaded
        strides = compat.tracing_output_strides()
        if strides is not None:
            strides.clear()
            strides.extend(self.output_strides)
        # NOTE: now, inside the compilation: the factory joins the runtime to the graph
        # being compiled (its memory pool and report).
        self.runtime = self.factory(self)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "runtime": None, "pool": None}
