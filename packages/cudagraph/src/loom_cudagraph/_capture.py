"""The capture core: how work is captured and replayed, on a CUDA device or simulated on the host.

One :class:`Capturer` serves both users of loom's CUDA graphs: the per-graph
segment runtime (:meth:`Capturer.capture`: ``fn(static_inputs)`` into a graph
handle and its static outputs; the capture takes the input list over, so
memory ``fn`` frees during the capture can be reused by it) and whole-step
capture (``loom_step``: :meth:`Capturer.warm_up` runs the step eagerly as a
capture will see it, :meth:`Capturer.capture_call` records a zero-argument
call). Both replay through ``replayer(graph)``, a zero-argument callable bound
once per recording (the C++ ``replay`` of the graph on CUDA), and make memory
pools with :meth:`Capturer.new_pool_handle`.
:class:`CudaCapturer` uses ``torch.cuda.CUDAGraph``; the default CUDA generator
is registered by the graph itself, so each replay advances the Philox offset
and draws fresh random numbers.
:class:`HostCapturer` is the one host stand-in: a capture runs ``fn`` and undoes
what the run changed (a CUDA capture runs nothing), a replay runs ``fn`` again
and writes the results into the same output memory, which reproduces a
replay's aliasing on CPU so the runtimes' bookkeeping is testable without a
GPU. Like a CUDA pool, the host graph of a segment owns its outputs' memory:
the outputs it returns view that memory without owning it, so they die like a
capture's outputs do while the memory stays.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from loom_cudagraph._torch_compat import (
    clear_cublas_workspaces,
    cuda_graph_replay,
    holds_own_memory,
    non_owning_alias,
)

#: A weak reference to an input's storage. The Python storage object lives exactly as
#: long as the storage (PyTorch preserves it while the C++ side holds the storage), so
#: ``ref() is None`` once the memory went back to the allocator.
StorageRef = weakref.ref[torch.UntypedStorage]

__all__ = ["Capturer", "CudaCapturer", "HostCapturer"]

SegmentFn = Callable[[list[Any]], Sequence[Any]]
CallFn = Callable[[], Sequence[Any]]
T = TypeVar("T")


class Capturer(Protocol):
    """What the runtimes need from a capture backend."""

    #: the device type whose tensors a capture reads and writes
    device_type: str

    def available(self) -> bool:
        """Whether captures can run here (a CUDA device is present)."""
        ...

    def new_pool_handle(self) -> Any: ...

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        """Record ``fn(inputs)`` (``inputs`` is the capture's to consume); return
        the graph handle and its static outputs."""
        ...

    def warm_up(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` eagerly as a capture of it will run (on the capture's side of the
        device), with each host synchronization reported as a warning."""
        ...

    def capture_call(
        self, fn: CallFn, pool: Any, keep: Sequence[torch.Tensor] = ()
    ) -> tuple[Any, list[Any]]:
        """Record ``fn()`` (a whole step) into ``pool``; return the graph handle and the
        values ``fn`` returned. ``keep``: tensors whose values the capture must leave
        as they were (a CUDA capture runs nothing; the host stand-in undoes its run)."""
        ...

    def replay(self, graph: Any) -> None: ...

    def replayer(self, graph: Any) -> Callable[[], object]:
        """``graph``'s replay as a zero-argument callable, bound once per recording."""
        ...

    def pool_bytes(self, before: int) -> int:
        """Bytes the allocator reserved since ``before`` (a :meth:`reserved` reading)."""
        ...

    def reserved(self) -> int: ...


@contextlib.contextmanager
def _restoring_stream() -> Iterator[None]:
    """Put the current stream back if a capture fails.

    NOTE: ``torch.cuda.graph``'s ``__exit__`` leaves its capture stream current
    when ``capture_end`` raises.
    """
    stream = torch.cuda.current_stream()
    try:
        yield
    except BaseException:
        torch.cuda.set_stream(stream)
        raise


class CudaCapturer:
    """Capture with ``torch.cuda.graph`` on one device: a segment on a side stream
    shared by every capturer of the device, a whole step on the current stream."""

    device_type = "cuda"

    # NOTE: one capture stream per device for every capturer, so graphs that
    # share a pool allocate on one stream and can reuse each other's freed blocks.
    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = torch.device("cuda") if device is None else device
        #: the side stream of whole-step warm-ups and captures (made on first use)
        self._warm_stream: torch.cuda.Stream | None = None

    def available(self) -> bool:
        return torch.cuda.is_available()

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
                with (
                    _restoring_stream(),
                    torch.cuda.graph(
                        graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                    ),
                ):
                    outputs = list(fn(inputs))
            finally:
                clear_cublas_workspaces()
        return graph, outputs

    def _step_stream(self) -> torch.cuda.Stream:
        """The side stream of whole-step warm-ups and captures (made on first use)."""
        if self._warm_stream is None:
            with torch.cuda.device(self.device):
                self._warm_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return self._warm_stream

    def warm_up(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the whole-step side stream under CUDA's sync debug mode set to warn."""
        side = self._step_stream()
        side.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.cuda.stream(side):
                out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture_call(
        self, fn: CallFn, pool: Any, keep: Sequence[torch.Tensor] = ()
    ) -> tuple[Any, list[Any]]:
        # NOTE: on the warm-ups' stream: what a warm-up left bound to its stream (the
        # AccumulateGrad nodes DDP keeps, made on it: see loom_step) runs on the capture
        # stream itself, with no cross-stream use whose frees a capture must defer.
        graph = torch.cuda.CUDAGraph()
        with _restoring_stream(), torch.cuda.graph(graph, pool=pool, stream=self._step_stream()):
            out = list(fn())
        return graph, out

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
        # NOTE: no empty_cache here: the first replay, right after the capture, may read
        # blocks freed during it that no pool owns, which emptying would hand back to
        # the driver. ``before`` was read on an emptied cache, and a capture allocates
        # from its pool only, so the growth is the pool's.
        torch.cuda.synchronize(self.device)
        return max(0, int(torch.cuda.memory_reserved(self.device)) - before)


class _HostGraph:
    """A segment's host graph: ``fn(inputs)`` again, written into the outputs' memory."""

    def __init__(
        self,
        fn: SegmentFn,
        inputs: list[Any],
        memory: list[Any],
        owners: list[_HostGraph],
        unowned: dict[int, StorageRef],
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        #: the outputs' memory, owned by the graph as a pool owns a capture's
        self.memory = memory
        #: graphs whose memory ``inputs`` view without owning it
        self.owners = owners
        #: position -> the storage of each input that no earlier graph owns
        self.unowned = unowned
        self.replays = 0

    def replay(self) -> None:
        if self.replays == 0:
            # NOTE: on CUDA, the first replay comes right after the capture, with
            # the capture's own input addresses: an input no pool owns that died
            # meanwhile may be the driver's memory by now (an illegal address).
            freed = sorted(i for i, ref in self.unowned.items() if ref() is None)
            if freed:
                raise RuntimeError(
                    f"HostCapturer: the first replay reads inputs {freed}, whose memory "
                    "was freed after the capture (no pool owns it): on CUDA this reads "
                    "an address the allocator may have given back to the driver"
                )
            self.unowned = {}
        self.replays += 1
        _write_into(self.memory, self.fn(list(self.inputs)))


class _HostCall:
    """A whole step's host graph: ``fn()`` again, written into the captured values."""

    def __init__(self, fn: CallFn, memory: list[Any]) -> None:
        self.fn = fn
        self.memory = memory
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        _write_into(self.memory, self.fn())


def _write_into(memory: Sequence[Any], fresh: Sequence[Any]) -> None:
    """Each tensor of ``fresh`` copied into its captured twin in ``memory``, as a
    replay writes the memory the capture allocated."""
    with torch.no_grad():
        for static, new in zip(memory, fresh, strict=True):
            if isinstance(static, torch.Tensor) and isinstance(new, torch.Tensor):
                if static is not new:
                    static.copy_(new)


def _strided(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.layout == torch.strided


def _backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds memory (FSDP-style code frees a parameter's
    storage between uses with ``untyped_storage().resize_(0)``). A wrapper
    subclass (a DTensor shard) counts as backed: its inner tensors hold its memory."""
    if not holds_own_memory(t):
        return True
    storage = t.untyped_storage()
    return storage.data_ptr() != 0 and storage.nbytes() > 0


@contextlib.contextmanager
def _undone(
    tensors: Sequence[torch.Tensor],
    storages: Sequence[StorageRef | None] = (),
) -> Iterator[None]:
    """The block's writes to ``tensors`` undone when it ends (a CUDA capture executes
    nothing on the device: only replays change values, as there).

    ``storages``: per tensor, a weak reference to the input's own storage where
    ``tensors`` holds an alias that does not own its memory, else ``None`` (the
    tensor's own storage, or memory an earlier host graph owns, which stays when
    the input dies). A tensor whose storage held no memory when the block began
    has nothing to restore; one whose storage the block freed (resized to 0, or
    let die) or moved keeps what the block did: resizing is the allocator's work
    on the host, which a CUDA capture does too.
    """
    where = list(storages) + [None] * (len(tensors) - len(storages))
    saved = [t.clone() if _backed(t) else None for t in tensors]
    yield
    with torch.no_grad():
        for t, ref, value in zip(tensors, where, saved, strict=True):
            if value is None:
                continue
            if ref is not None:
                # NOTE: ``t`` reads the memory the input had when the block began;
                # memory the block allocated for it anew (a resize) is elsewhere.
                storage = ref()
                gone = (
                    storage is None
                    or storage.nbytes() == 0
                    or storage.data_ptr() != t.untyped_storage().data_ptr()
                )
                del storage
            else:
                gone = not _backed(t)
            if not gone:
                t.copy_(value)


class HostCapturer:
    """A stand-in for CUDA graphs on the host: replay re-runs the function and
    overwrites the recorded outputs' memory in place, as a real replay would."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        #: memory address -> the graph that owns it
        self._owners: weakref.WeakValueDictionary[int, _HostGraph] = weakref.WeakValueDictionary()

    def available(self) -> bool:
        return True

    def new_pool_handle(self) -> Any:
        return object()

    def capture(self, fn: SegmentFn, inputs: list[Any], pool: Any) -> tuple[Any, list[Any]]:
        self.captures += 1
        owners: list[_HostGraph] = []
        kept: list[Any] = []
        storages: list[StorageRef | None] = []
        for v in inputs:
            if not _strided(v) or v.untyped_storage().data_ptr() == 0:
                kept.append(v)
                storages.append(None)
                continue
            owner = self._owners.get(v.untyped_storage().data_ptr())
            if owner is not None:
                # an earlier graph's output: view it (it may die, the memory stays)
                owners.append(owner)
                storages.append(None)
            else:
                storages.append(weakref.ref(v.untyped_storage()))
            # NOTE: as a CUDA graph, read the inputs' memory without owning it: a
            # replay comes only with a live tensor at each address the runtime reads
            # in place, and its own buffers hold the rest. Held here, an earlier
            # recording's output read in place would count as held for good.
            kept.append(non_owning_alias(v))
        del v  # NOTE: the list is the capture's: hold no input past its last use
        tensor_at = [p for p, t in enumerate(kept) if isinstance(t, torch.Tensor)]
        tensors = [kept[p] for p in tensor_at]
        input_memory = {t.untyped_storage().data_ptr() for t in tensors if _strided(t)}
        with _undone(tensors, [storages[p] for p in tensor_at]):
            outputs = list(fn(inputs))
        # NOTE: an output over an input's memory (passed through, or a view) is not
        # the graph's to keep or write: a CUDA graph holds no reference to it either.
        memory = [
            None if _strided(o) and o.untyped_storage().data_ptr() in input_memory else o
            for o in outputs
        ]
        unowned = {i: ref for i, ref in enumerate(storages) if ref is not None}
        graph = _HostGraph(fn, kept, memory, owners, unowned)
        handed: list[Any] = []
        for o in outputs:
            if _strided(o) and not o.requires_grad:
                ptr = o.untyped_storage().data_ptr()
                if ptr not in input_memory and ptr != 0:
                    self._owners[ptr] = graph
                    o = non_owning_alias(o)
            handed.append(o)
        return graph, handed

    def warm_up(self, fn: Callable[[], T]) -> T:
        return fn()

    def capture_call(
        self, fn: CallFn, pool: Any, keep: Sequence[torch.Tensor] = ()
    ) -> tuple[Any, list[Any]]:
        self.captures += 1
        with _undone(keep):
            out = list(fn())
        return _HostCall(fn, out), out

    def replay(self, graph: Any) -> None:
        self.replays += 1
        graph.replay()

    def replayer(self, graph: Any) -> Callable[[], object]:
        return functools.partial(self.replay, graph)

    def reserved(self) -> int:
        return 0

    def pool_bytes(self, before: int) -> int:
        return 0
