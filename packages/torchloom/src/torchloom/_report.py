"""What torchloom did with every graph it compiled since the last reset.

Each Dynamo graph handed to the backend gets one :class:`GraphRecord`: an id,
its inputs' metadata, the pipeline's timed steps with their durations, and
entries that steps add (hooks inlined or refused, resize passes, cache
hits and misses, CUDA-graph segments; a refusal entry keeps the package's
refusal as typed data in ``entry.refusal``), the steps' plans and pass results as the frozen
values the packages made (:meth:`GraphRecord.plan`: ``"hooks"``, ``"resize"``,
``"cache"``, ``"cudagraph.forward"``, ...), and the typed refusal of a graph
that runs eagerly. Text is rendered only by :meth:`Report.format`. Records are built by a mutable
:class:`GraphRecordBuilder` while compilation (and the lazily compiled
backward) runs; :func:`report` returns frozen snapshots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from loom_sidefx import Refusal
from torchloom._errors import Unsupported

__all__ = [
    "GraphRecord",
    "GraphRecordBuilder",
    "InputMeta",
    "Report",
    "ReportEntry",
    "StageRecord",
    "new_record",
    "report",
    "reset_records",
]


@dataclasses.dataclass(frozen=True, slots=True)
class InputMeta:
    """One graph input as the backend saw it (example values are fake)."""

    index: int
    kind: str  # "tensor", "symint", "int", "float", "bool", "other"
    dtype: str | None = None
    shape: tuple[str, ...] | None = None
    stride: tuple[str, ...] | None = None
    device: str | None = None
    requires_grad: bool | None = None

    def __str__(self) -> str:
        if self.kind != "tensor":
            return f"#{self.index} {self.kind}"
        shape = ", ".join(self.shape or ())
        grad = " grad" if self.requires_grad else ""
        return f"#{self.index} {self.dtype}[{shape}] {self.device}{grad}"


#: Whose work a timed section is: loom's own stages and glue, or PyTorch's
#: (AOTAutograd's trace, the partitioner, codegen) that loom calls.
Owner = Literal["loom", "torch"]


@dataclasses.dataclass(frozen=True, slots=True)
class StageRecord:
    """A timed section of one graph's compilation: its name, its own duration
    (time spent in sections nested inside it is theirs, not its), a one-line
    summary, and whose work it is."""

    name: str
    seconds: float
    detail: str = ""
    owner: Owner = "loom"


@dataclasses.dataclass(frozen=True, slots=True)
class ReportEntry:
    """A fact a stage recorded about a graph, e.g. ``("cache", "miss", ...)``."""

    area: str
    kind: str
    message: str
    data: tuple[tuple[str, Any], ...] = ()
    #: The package's own refusal this entry reports (a refused hook, a left-alone
    #: resize, a CUDA-graph skip, the fallback), as typed data; ``message`` is its text.
    refusal: Refusal[Any] | None = dataclasses.field(default=None, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.data).get(key, default)


@dataclasses.dataclass(frozen=True, slots=True)
class GraphRecord:
    """Everything torchloom did with one Dynamo graph."""

    graph_id: int
    name: str
    inputs: tuple[InputMeta, ...]
    options: tuple[tuple[str, Any], ...]
    stages: tuple[StageRecord, ...]
    entries: tuple[ReportEntry, ...]
    #: Why the graph runs eagerly, as text (``str(refusal)``), or ``None``.
    fallback: str | None
    graphs: tuple[tuple[str, str], ...]  # (kind, readable code) of each graph compiled
    #: The refusal behind ``fallback``, as typed data (its ``cause``: the package's own).
    refusal: Unsupported | None = None
    #: The steps' plans and pass results by name, as the packages' frozen values.
    plans: tuple[tuple[str, Any], ...] = ()

    def stage(self, name: str) -> StageRecord | None:
        return next((s for s in self.stages if s.name == name), None)

    def plan(self, name: str) -> Any:
        """The plan or pass result a step recorded under ``name``, or ``None``.

        ``"hooks"`` (``HooksPlan``), ``"resize"`` (``loom_resize.ResizePlan``),
        ``"cache"`` (``loom_cache.CacheKey``, or the ``CacheBypass`` that says why
        not), ``"cudagraph.<graph>"`` (``loom_cudagraph.PartitionPlan``),
        ``"resize.<graph>.<pass>"`` (``loom_sidefx.PassResult``), ``"hooks.placement"``
        (``loom_hops.Placement``), ``"grad_hooks"`` (``loom_hops.GradHookInlining``, a graph
        with ``grad_hook`` sites)::

            plan = torchloom.report()[0].plan("cudagraph.forward")
            plan.captured_segments
        """
        return next((value for key, value in self.plans if key == name), None)

    @property
    def loom_seconds(self) -> float:
        """Time spent in loom's own stages for this graph (PyTorch's work excluded)."""
        return sum(s.seconds for s in self.stages if s.owner == "loom")

    @property
    def compile_seconds(self) -> float:
        """Time the backend spent on this graph: loom's stages and PyTorch's work."""
        return sum(s.seconds for s in self.stages)


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    """All graph records since the last :func:`torchloom.reset`."""

    graphs: tuple[GraphRecord, ...]

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self) -> Any:
        return iter(self.graphs)

    def __getitem__(self, i: int) -> GraphRecord:
        return self.graphs[i]

    def entries(self, area: str | None = None) -> tuple[ReportEntry, ...]:
        return tuple(e for g in self.graphs for e in g.entries if area in (None, e.area))

    def format(self) -> str:
        """A plain-text summary, one block per graph."""
        lines: list[str] = []
        for g in self.graphs:
            head = f"graph {g.graph_id} ({g.name}): {len(g.inputs)} inputs"
            if g.fallback:
                head += f" — eager fallback: {g.fallback}"
            lines.append(head)
            for s in g.stages:
                if s.seconds < 5e-5:  # kept in the record, not worth a line
                    continue
                owner = "" if s.owner == "loom" else f"({s.owner}) "
                lines.append(f"  {s.name:<26} {s.seconds * 1e3:9.1f} ms  {owner}{s.detail}")
            if g.stages:
                lines.append(
                    f"  loom's own stages {g.loom_seconds * 1e3:.1f} ms of "
                    f"{g.compile_seconds * 1e3:.1f} ms in the backend"
                )
            for e in g.entries:
                lines.append(f"  [{e.area}] {e.kind}: {e.message}")
        return "\n".join(lines)

    __str__ = format


class GraphRecordBuilder:
    """Collects one graph's record while it compiles; :meth:`build` snapshots it."""

    def __init__(
        self, graph_id: int, name: str, inputs: Sequence[InputMeta], options: Mapping[str, Any]
    ) -> None:
        self.graph_id = graph_id
        self.name = name
        self.inputs = tuple(inputs)
        self.options = tuple(sorted(options.items()))
        self._stages: list[StageRecord] = []
        self._entries: list[ReportEntry] = []
        self._graphs: list[tuple[str, str]] = []
        self.refusal: Unsupported | None = None
        self._plans: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._open: list[float] = []  # time spent in sections nested in each open one

    @property
    def fallback(self) -> str | None:
        return None if self.refusal is None else str(self.refusal)

    def refuse(self, reason: Unsupported) -> None:
        """The graph runs eagerly for ``reason``."""
        self.refusal = reason

    def add_stage(self, name: str, seconds: float, detail: str = "", owner: Owner = "loom") -> None:
        with self._lock:
            self._stages.append(StageRecord(name, seconds, detail, owner))

    @contextlib.contextmanager
    def timed(self, name: str, detail: str = "", owner: Owner = "loom") -> Iterator[None]:
        """Time a section; its record keeps only its own time, not its nested sections'."""
        start = time.perf_counter()
        self._open.append(0.0)
        try:
            yield
        finally:
            total = time.perf_counter() - start
            nested = self._open.pop()
            if self._open:
                self._open[-1] += total
            self.add_stage(name, max(total - nested, 0.0), detail, owner)

    def add_entry(
        self,
        area: str,
        kind: str,
        message: str,
        *,
        refusal: Refusal[Any] | None = None,
        **data: Any,
    ) -> None:
        """Record a fact; ``data`` holds plain values, ``refusal`` the typed refusal."""
        entry = ReportEntry(area, kind, message, tuple(sorted(data.items())), refusal)
        with self._lock:
            self._entries.append(entry)

    def add_plan(self, name: str, value: Any) -> None:
        """Keep a step's plan or pass result (a frozen value) under ``name``; the last wins."""
        with self._lock:
            self._plans.pop(name, None)
            self._plans[name] = value

    def add_graph(self, kind: str, code: str) -> None:
        with self._lock:
            self._graphs.append((kind, code))

    def build(self) -> GraphRecord:
        with self._lock:
            return GraphRecord(
                self.graph_id,
                self.name,
                self.inputs,
                self.options,
                tuple(self._stages),
                tuple(self._entries),
                self.fallback,
                tuple(self._graphs),
                self.refusal,
                tuple(self._plans.items()),
            )


_records: list[GraphRecordBuilder] = []
_ids = itertools.count()
_lock = threading.Lock()


def new_record(
    name: str, inputs: Sequence[InputMeta], options: Mapping[str, Any]
) -> GraphRecordBuilder:
    with _lock:
        builder = GraphRecordBuilder(next(_ids), name, inputs, options)
        _records.append(builder)
        return builder


def report() -> Report:
    """Records of every graph compiled by ``loom`` since :func:`torchloom.reset`.

    >>> torchloom.reset(); torch.compile(f, backend="loom")(x)
    >>> print(torchloom.report())          # doctest: +SKIP
    graph 0 (forward): 1 inputs
      aot                       35.2 ms  ...
    """
    with _lock:
        return Report(tuple(b.build() for b in _records))


def reset_records() -> None:
    global _ids
    with _lock:
        _records.clear()
        _ids = itertools.count()
