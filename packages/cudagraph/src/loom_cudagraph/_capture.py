"""How a segment is captured and replayed: on a CUDA device, or simulated on the host.

A :class:`Capturer` turns ``fn(static_inputs)`` into a graph handle and its
static outputs, replays the handle, and makes memory pools. A capturer may
also offer ``replayer(graph)``, a zero-argument callable bound once per
recording (the C++ ``replay`` of the graph on CUDA), which the per-call path calls
instead of ``replay(graph)``.
:class:`CudaCapturer` uses ``torch.cuda.CUDAGraph`` with private pools and a
side stream; the default CUDA generator is registered by the graph itself, so
each replay advances the Philox offset and draws fresh random numbers.
:class:`HostCapturer` runs ``fn`` again on every replay and writes the results
into the same output tensors, which reproduces a replay's aliasing on CPU so
the runtime's bookkeeping is testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from loom_cudagraph._torch_compat import cuda_graph_replay

__all__ = ["Capturer", "CudaCapturer", "HostCapturer"]

SegmentFn = Callable[[list[Any]], Sequence[Any]]


class Capturer(Protocol):
    """What the runtime needs from a capture backend."""

    def new_pool_handle(self) -> Any: ...

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        """Record ``fn(inputs)``; return the graph handle and its static outputs."""
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
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                outputs = list(fn(list(inputs)))
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
    def __init__(self, fn: SegmentFn, inputs: list[Any], outputs: list[Any]) -> None:
        self.fn = fn
        self.inputs = inputs
        self.outputs = outputs
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        fresh = self.fn(list(self.inputs))
        for static, new in zip(self.outputs, fresh, strict=True):
            if isinstance(static, torch.Tensor) and static is not new:
                with torch.no_grad():
                    static.copy_(new)


class HostCapturer:
    """A stand-in for CUDA graphs on the host: replay re-runs the function and
    overwrites the recorded output tensors in place, as a real replay would."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def new_pool_handle(self) -> Any:
        return object()

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        # NOTE: a CUDA capture executes nothing; undo the run's input mutations
        # so that only replays change state, as on the device.
        self.captures += 1
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        saved = [t.clone() for t in tensors]
        outputs = list(fn(list(inputs)))
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)
        return _HostGraph(fn, list(inputs), outputs), outputs

    def replay(self, graph: Any) -> None:
        self.replays += 1
        graph.replay()

    def reserved(self) -> int:
        return 0

    def pool_bytes(self, before: int) -> int:
        return 0
