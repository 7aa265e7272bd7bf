"""How a segment is captured and replayed: on a CUDA device, or simulated on the host.

A :class:`Capturer` turns ``fn(static_inputs)`` into a graph handle and its
static outputs, replays the handle, and makes memory pools. The capture takes
the input list over (``fn`` is boxed and frees what it no longer needs, so
memory freed during the capture can be reused by it). A capturer may
also offer ``replayer(graph)``, a zero-argument callable bound once per
recording (the C++ ``replay`` of the graph on CUDA), which the per-call path calls
instead of ``replay(graph)``.
:class:`CudaCapturer` uses ``torch.cuda.CUDAGraph`` with private pools and a
side stream; the default CUDA generator is registered by the graph itself, so
each replay advances the Philox offset and draws fresh random numbers.
:class:`HostCapturer` runs ``fn`` again on every replay and writes the results
into the same output memory, which reproduces a replay's aliasing on CPU so
the runtime's bookkeeping is testable without a GPU. Like a CUDA pool, the
host graph owns its outputs' memory: the outputs it returns view that memory
without owning it, so they die like a capture's outputs do while the memory
stays.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from loom_cudagraph._torch_compat import (
    clear_cublas_workspaces,
    cuda_graph_replay,
    non_owning_alias,
)

__all__ = ["Capturer", "CudaCapturer", "HostCapturer"]

SegmentFn = Callable[[list[Any]], Sequence[Any]]


class Capturer(Protocol):
    """What the runtime needs from a capture backend."""

    def new_pool_handle(self) -> Any: ...

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        """Record ``fn(inputs)`` (``inputs`` is the capture's to consume); return
        the graph handle and its static outputs."""
        ...

    def replay(self, graph: Any) -> None: ...

    def pool_bytes(self, before: int) -> int:
        """Bytes the allocator reserved since ``before`` (a :meth:`reserved` reading)."""
        ...

    def reserved(self) -> int: ...


class CudaCapturer:
    """Capture with ``torch.cuda.graph`` on one device, on a side stream."""

    # NOTE: one capture stream per device for every capturer, so graphs that
    # share a pool allocate on one stream and can reuse each other's freed blocks.
    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_pool_handle(self) -> Any:
        with torch.cuda.device(self.device):
            return torch.cuda.graph_pool_handle()

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        with torch.cuda.device(self.device):
            index = torch.cuda.current_device()
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            graph = torch.cuda.CUDAGraph()
            # NOTE: cuBLAS keeps a workspace per stream; cleared before, the
            # capture allocates its own in the pool, and cleared after, it is
            # freed there instead of staying allocated (it is scratch memory).
            clear_cublas_workspaces()
            try:
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    outputs = list(fn(inputs))
            finally:
                clear_cublas_workspaces()
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def replayer(self, graph: Any) -> Callable[[], object]:
        """The graph's C++ replay, bound: no Python frame between the runtime and the launch."""
        return cuda_graph_replay(graph)

    def reserved(self) -> int:
        # NOTE: torch.cuda.graph empties the cache before capturing; do it here
        # too, so the difference around a capture is the pool's growth.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(self.device))

    def pool_bytes(self, before: int) -> int:
        return max(0, self.reserved() - before)


class _HostGraph:
    def __init__(
        self, fn: SegmentFn, inputs: list[Any], memory: list[Any], owners: list[_HostGraph]
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        #: the outputs' memory, owned by the graph as a pool owns a capture's
        self.memory = memory
        #: graphs whose memory ``inputs`` view without owning it
        self.owners = owners
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        fresh = self.fn(list(self.inputs))
        for static, new in zip(self.memory, fresh, strict=True):
            if isinstance(static, torch.Tensor) and static is not new:
                with torch.no_grad():
                    static.copy_(new)


def _strided(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.layout == torch.strided


class HostCapturer:
    """A stand-in for CUDA graphs on the host: replay re-runs the function and
    overwrites the recorded outputs' memory in place, as a real replay would."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        #: memory address -> the graph that owns it
        self._owners: weakref.WeakValueDictionary[int, _HostGraph] = weakref.WeakValueDictionary()

    def new_pool_handle(self) -> Any:
        return object()

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        # NOTE: a CUDA capture executes nothing; undo the run's input mutations
        # so that only replays change state, as on the device.
        self.captures += 1
        owners: list[_HostGraph] = []
        kept: list[Any] = []
        for v in inputs:
            owner = self._owners.get(v.untyped_storage().data_ptr()) if _strided(v) else None
            if owner is not None:
                # an earlier graph's output: view it (it may die, the memory stays)
                owners.append(owner)
                kept.append(non_owning_alias(v))
            else:
                kept.append(v)
        del v  # NOTE: the list is the capture's: hold no input past its last use
        tensors = [t for t in kept if isinstance(t, torch.Tensor)]
        saved = [t.clone() for t in tensors]
        input_memory = {t.untyped_storage().data_ptr() for t in tensors if _strided(t)}
        outputs = list(fn(inputs))
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)
        graph = _HostGraph(fn, kept, outputs, owners)
        handed: list[Any] = []
        for o in outputs:
            if _strided(o) and not o.requires_grad:
                ptr = o.untyped_storage().data_ptr()
                if ptr not in input_memory and ptr != 0:
                    self._owners[ptr] = graph
                    o = non_owning_alias(o)
            handed.append(o)
        return graph, handed

    def replay(self, graph: Any) -> None:
        self.replays += 1
        graph.replay()

    def reserved(self) -> int:
        return 0

    def pool_bytes(self, before: int) -> int:
        return 0
