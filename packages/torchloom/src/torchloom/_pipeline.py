"""The ``loom`` pipeline: one function whose steps appear in the order they run.

::

    compile_graph(gm, example_inputs, options)
     ├─ snapshot          options, active saved-tensor hooks, grad_hook sites     → Snapshot
     ├─ prepare           hooks traced, resize plan, cache key                    → Prepared
     ├─ compile_context   the CUDA-graph session joined; Dynamo's hook inlining off
     ├─ serve_from_cache  a hit: AOTAutograd's stored result, nothing traced     → Compiled
     │                      (under torch.distributed, served on every rank or none)
     │  or compile_cold   loom's passes over Dynamo's graph, then AOTAutograd with
     │                      loom's compilers:
     │                      _partition   partition, saved-tensor hooks placed  → fw, bw, placement
     │                      compile      per aten graph: loom's passes, then codegen
     │                                   chosen (CUDA-graph segments or the whole graph)
     │                      then the result stored in the cache (after the first
     │                      backward when AOTAutograd compiles it lazily)         → Compiled
     └─ wrap_runtime      resize storage guard, hook guards and pack effects, the
                          DDP optimizer's fake first call answered                → callable

Each step takes and returns frozen values. What is mutable is named: the graph's
report builder (``Snapshot.record``), which every step writes to and which keeps
the plans (``GraphRecord.plan``); the graph's :class:`CudagraphSession` (its memory
pool and plans, passed beside the frozen values); and, within a cold compile, the
compilers AOTAutograd calls back (:class:`_ColdCompilers`: the placement the
partition step returned, the graphs compiled so far). Every step is timed into the
graph's record behind :func:`torchloom.report` with its own time and owner. A step
refuses a graph by raising :class:`~torchloom.LoomRefusal`: the graph then runs
eagerly with the reason in the log and the report, or the refusal is raised in
strict mode.
:class:`Pipeline` holds the parts a test replaces (a capturer, a store, extra
passes); ``backend="loom"`` runs the default one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
from torch.fx import GraphModule

import loom_cache
import loom_cudagraph
import loom_hops
import loom_resize
from loom_sidefx import user_frame
from torchloom import _cudagraph, _hooks
from torchloom import _torch_compat as compat
from torchloom._aot_cache import AotCacheSlot, CacheNotServed, aot_cache_slot
from torchloom._cache import (
    CacheLookup,
    CacheRun,
    StoreAfterBackward,
    cache_key,
    cache_store,
    finish_cold,
    look_up,
    record_hit,
    replay_artifact,
)
from torchloom._cache_ranks import (
    CacheAgreement,
    agree_on_bypass,
    agree_on_lookup,
    cache_agreement,
)
from torchloom._cudagraph import (
    CudagraphSession,
    compile_segmented,
    cudagraph_error,
    cudagraph_session,
    cudagraph_settings,
    release_graphs,
    replay_plans,
)
from torchloom._ddp_optimizer import answer_fake_first_call
from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
from torchloom._grad_hooks import grad_hooks_context, inline_grad_hooks
from torchloom._hooks import (
    HookPlacement,
    HooksPlan,
    hooks_compile_context,
    in_placement_order,
    inline_hook_graphs,
    lifted_hook_inputs,
    order_tensor_hooks,
    place_hooks,
    prepare_hooks,
    with_hook_values,
    with_saved_strides,
    with_unpack_effects,
    wrap_hooks_runtime,
)
from torchloom._log import get_logger
from torchloom._options import LoomOptions, resolve_options
from torchloom._output_code import EagerOutputCode
from torchloom._report import GraphRecordBuilder, InputMeta, new_record
from torchloom._resize import guard_storage_sizes, plan_resizes, resize_passes, rewrite_fills
from torchloom._values import Codegen, ExampleInputs, GraphKind, Snapshot

if TYPE_CHECKING:
    from torchloom._cudagraph import PlanFn

__all__ = [
    "Compiled",
    "CompiledSource",
    "DynamoPass",
    "GraphPass",
    "PartitionPass",
    "Pipeline",
    "Prepared",
    "compile_graph",
    "eager_codegen",
    "input_metadata",
]

log = get_logger("pipeline")
graphs_log = get_logger("graphs")

#: An extra pass over Dynamo's graph, after loom's, before AOTAutograd.
DynamoPass = Callable[[GraphModule], GraphModule]
#: An extra pass over the partitioned forward and backward, after loom's hook placement.
PartitionPass = Callable[[GraphModule, GraphModule], tuple[GraphModule, GraphModule]]
#: An extra pass over one aten graph, after loom's, before codegen.
GraphPass = Callable[[GraphKind, GraphModule], GraphModule]
#: Wraps one compiled aten graph (a boxed callable).
CompiledWrapper = Callable[[GraphKind, Callable[..., Any]], Callable[..., Any]]


def eager_codegen(
    gm: GraphModule, example_inputs: Sequence[Any], static_input_idxs: Sequence[int]
) -> Callable[..., Any]:
    """``codegen="eager"``: the FX graph run as it is, with the boxed convention."""
    return compat.boxed_graph_callable(gm)


@dataclasses.dataclass(frozen=True, slots=True)
class Pipeline:
    """The replaceable parts of the pipeline; calling it is a ``torch.compile`` backend.

    The default instance is what ``backend="loom"`` runs. Tests pass their own
    parts instead of patching module globals::

        host = Pipeline(capturer=loom_cudagraph.HostCapturer(), cudagraph_device="cpu")
        torch.compile(f, backend=host, options={"cudagraphs": True})

    Parts that stand in for loom's own (``capturer``, ``store``, ``eager_codegen``,
    ``plan_graph``, ``place_saved_tensor_hooks``) must produce what loom's would;
    the extra passes and wrappers are named in the cache key.
    """

    #: Captures CUDA graphs (``None``: the CUDA capturer); ``cudagraph_device`` plans for it.
    capturer: loom_cudagraph.Capturer | None = None
    cudagraph_device: str | None = None
    #: The cache store of this process.
    store: Callable[[], loom_cache.TieredStore] = cache_store
    #: The ranks' agreement on each lookup under torch.distributed (``None``: none),
    #: given the option ``cache_agree``.
    agreement: Callable[[bool], CacheAgreement | None] = cache_agreement
    #: Codegen for ``codegen="eager"`` graphs the cache does not take (cache off).
    eager_codegen: Codegen = eager_codegen
    # NOTE: loom's planner and placement by wrappers that import them at their first
    # call: the backend's import does not load what a plain graph never runs.
    plan_graph: PlanFn = _cudagraph.plan_graph
    place_saved_tensor_hooks: Callable[..., Any] = _hooks.place_saved_tensor_hooks
    dynamo_passes: tuple[DynamoPass, ...] = ()
    partition_passes: tuple[PartitionPass, ...] = ()
    graph_passes: tuple[GraphPass, ...] = ()
    compiled_wrappers: tuple[CompiledWrapper, ...] = ()

    def __call__(
        self,
        gm: GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, resolve_options(mode, options), self)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this on a pipeline used as a backend: the
        captured CUDA graphs of the process are dropped (see :func:`release_graphs`)."""
        release_graphs()

    def describe(self) -> tuple[str, ...]:
        """The extra passes and wrappers, by qualified name (a cache key component)."""
        extra = (*self.dynamo_passes, *self.partition_passes, *self.graph_passes)
        return tuple(
            f"{getattr(p, '__module__', '?')}.{getattr(p, '__qualname__', type(p).__name__)}"
            for p in (*extra, *self.compiled_wrappers)
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """What every later step reads: the snapshot, the hooks plan, the one resize
    plan and the cache key (or why the graph bypasses the cache)."""

    snapshot: Snapshot
    hooks: HooksPlan
    resize: loom_resize.ResizePlan
    key: loom_cache.CacheKey | loom_cache.CacheBypass


class CompiledSource(enum.Enum):
    """Where a compiled graph came from."""

    #: Served from loom's cache: nothing traced, partitioned or generated.
    CACHE = "cache"
    #: Compiled cold: AOTAutograd with loom's partition step, passes and codegen.
    COLD = "cold"


@dataclasses.dataclass(frozen=True, slots=True)
class Compiled:
    """The callable AOTAutograd returned, where it came from, and what the hook
    placement did while compiling (nothing on a hit: the placement is in the graphs)."""

    fn: Callable[..., Any]
    source: CompiledSource
    hooks: HookPlacement = dataclasses.field(default_factory=HookPlacement)


# --- the pipeline ---------------------------------------------------------------------------


def compile_graph(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    options: LoomOptions,
    pipeline: Pipeline | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph with the ``loom`` pipeline."""
    parts = pipeline or DEFAULT_PIPELINE
    record = new_record(
        str(gm.meta.get("dynamo_compile_id", "graph")),
        input_metadata(example_inputs),
        options.as_dict(),
    )
    with record.timed("report.graphs"):
        _show(record, "dynamo", gm)
    if not _has_tensor_work(gm):
        reason = Unsupported(RefusalKind.NO_TENSOR_WORK, "", "the graph has no tensor work")
        return _eager_fallback(record, gm, reason)
    snapshot = take_snapshot(gm, example_inputs, options, record)
    if options.codegen == "inductor":
        # As Inductor's backend does on entry, hit or miss: the compile workers wake
        # now. A hit loads its kernels through them too (those its entry does not
        # bundle as static launchers); woken at the first such kernel, they are not
        # ready in time and the kernels load in this process one at a time.
        with record.timed("inductor.workers", owner="torch"):
            compat.warm_compile_workers(example_inputs)
    try:
        prepared = prepare(parts, snapshot)
        # NOTE: mutable, so not part of ``Prepared``: the memory pool and plans of the
        # graph's CUDA graphs, filled while serving or compiling.
        session = CudagraphSession(
            snapshot.graph_id, record, parts.capturer, parts.cudagraph_device
        )
        with compile_context(prepared, session):
            served = serve_from_cache(parts, prepared, session)
            compiled = (
                served
                if isinstance(served, Compiled)
                else compile_cold(parts, prepared, session, served)
            )
        return wrap_runtime(prepared, compiled)
    except compat.CONTROL_FLOW_EXCEPTIONS as signal:
        # Not a refusal: Dynamo restarts (or skips) the frame and calls the backend again.
        record.add_entry(
            "pipeline", "restart", f"Dynamo asked to {type(signal).__name__}; not compiled here"
        )
        log.debug("graph %d: %s propagates to Dynamo", record.graph_id, type(signal).__name__)
        raise
    except LoomRefusal as refusal:
        if options.strict:
            raise
        return _eager_fallback(record, gm, refusal.reason)
    finally:
        # NOTE: the compiled function keeps the snapshot (through loom's
        # compilers, for the lazy backward); not the first call's tensors.
        snapshot.inputs.release()


def take_snapshot(
    gm: GraphModule, example_inputs: Sequence[Any], options: LoomOptions, record: GraphRecordBuilder
) -> Snapshot:
    """Step 1: what the compilation depends on, read once."""
    with record.timed("snapshot"):
        return Snapshot(
            gm,
            ExampleInputs(example_inputs),
            options,
            record,
            loom_hops.active_saved_tensors_hooks(),
            bool(loom_hops.grad_hook_sites(gm)),
        )


def prepare(parts: Pipeline, snapshot: Snapshot) -> Prepared:
    """Step 2: the hooks traced, the resize plan, the cache key."""
    record, options = snapshot.record, snapshot.options
    with record.timed("hooks.prepare"):
        hooks = prepare_hooks(snapshot)
    with record.timed("resize.plan"):
        resize = plan_resizes(snapshot)
    with record.timed("cache.key"):
        settings = {
            "cudagraph": cudagraph_settings(options, parts.capturer, parts.cudagraph_device)
        }
        key = cache_key(snapshot, hooks, settings, parts.describe())
    record.add_plan("hooks", hooks)
    record.add_plan("resize", resize)
    record.add_plan("cache", key)
    return Prepared(snapshot, hooks, resize, key)


@contextlib.contextmanager
def compile_context(prepared: Prepared, session: CudagraphSession) -> Any:
    """Around serving or compiling: the CUDA-graph session runtimes join, and Dynamo's
    own saved-tensor hook inlining off where loom places (or refuses) the pair."""
    with cudagraph_session(session), hooks_compile_context(prepared.hooks):
        yield


def serve_from_cache(
    parts: Pipeline, prepared: Prepared, session: CudagraphSession
) -> Compiled | CacheLookup | None:
    """Step 3a: a hit serves AOTAutograd's stored result (no tracing, no passes, no
    codegen) and replays the cold compilation's report. Otherwise it returns the
    lookup that missed, with the reason (``None``: the graph bypasses the cache)."""
    key, record = prepared.key, prepared.snapshot.record
    agreement = _cache_agreement(parts, prepared)
    if isinstance(key, loom_cache.CacheBypass):
        if agreement is not None:  # a miss on this rank: the ranks stay paired
            agree_on_bypass(record, agreement)
        return None
    with record.timed("cache.load"):
        lookup = look_up(parts.store(), key)
    if agreement is not None:
        lookup = agree_on_lookup(record, agreement, lookup)
    if lookup.artifact is None:
        return lookup
    slot = AotCacheSlot(key=f"loom-{key.digest}", load=lookup.artifact.aot_result, serve_only=True)
    try:
        with aot_cache_slot(slot), grad_hooks_context(prepared.snapshot):
            fn = _aot_serve(prepared.snapshot)
    except CacheNotServed:
        reason = f"stored artifact could not be served: {slot.load_error}"
        log.warning("graph %d: %s", record.graph_id, reason)
        return dataclasses.replace(lookup, artifact=None, reason=reason)
    with record.timed("cache.replay"):
        replay_artifact(
            record, lookup.artifact, {"cudagraph": functools.partial(replay_plans, session)}
        )
        record_hit(record, lookup)
    return Compiled(fn, CompiledSource.CACHE)


def _cache_agreement(parts: Pipeline, prepared: Prepared) -> CacheAgreement | None:
    """The ranks' agreement on this graph's lookup: under torch.distributed with more
    than one rank, whenever the cache is on (a graph that bypasses it takes part as a
    miss); see :mod:`torchloom._cache_ranks`."""
    key = prepared.key
    disabled = (
        isinstance(key, loom_cache.CacheBypass) and key.kind is loom_cache.CacheBypassKind.DISABLED
    )
    if disabled:
        return None
    return parts.agreement(prepared.snapshot.options.cache_agree)


def compile_cold(
    parts: Pipeline, prepared: Prepared, session: CudagraphSession, lookup: CacheLookup | None
) -> Compiled:
    """Step 3b: AOTAutograd with loom's partition step and per-graph passes and
    codegen; with a cache key (``lookup`` missed), the result is stored, after the
    first backward when AOTAutograd compiles that lazily."""
    record = prepared.snapshot.record
    if lookup is None:
        with grad_hooks_context(prepared.snapshot):
            return _compile_cold(parts, prepared, session, None)[0]
    slot = AotCacheSlot(key=f"loom-{lookup.key.digest}")
    built = record.build()
    run = CacheRun(
        lookup,
        slot,
        len(built.entries),
        len(built.graphs),
        lambda: {"cudagraph": session.payload()},
    )
    with aot_cache_slot(slot), grad_hooks_context(prepared.snapshot):
        compiled, compilers = _compile_cold(parts, prepared, session, run)
    hooks = prepared.hooks
    eager_hooks = hooks.refused or hooks.past_limit or compiled.hooks.refused
    with record.timed("cache.store"):
        compilers.after_backward = finish_cold(
            record, run, compilers.compiled, "the hooks stay eager" if eager_hooks else None
        )
    return compiled


def wrap_runtime(prepared: Prepared, compiled: Compiled) -> Callable[..., Any]:
    """Step 4: the callable for Dynamo: storage-size guard, hook guards and effects;
    under Dynamo's DDP optimizer, its first call on fake tensors answered without
    running anything (see :mod:`torchloom._ddp_optimizer`)."""
    snapshot = prepared.snapshot
    with snapshot.record.timed("runtime.wrap"):
        fn = guard_storage_sizes(compiled.fn, snapshot, prepared.resize)
        fn = wrap_hooks_runtime(fn, prepared.hooks, compiled.hooks)
        cold = compiled.source is CompiledSource.COLD
        return answer_fake_first_call(fn, compiled.fn if cold else None, snapshot.gm)


# --- AOTAutograd: serving and compiling -----------------------------------------------------


def _aot_serve(snapshot: Snapshot) -> Callable[..., Any]:
    """AOTAutograd serving the stored result its cache slot holds: loom's compilers
    must not run, and a traced result needs no decompositions."""
    backend = compat.aot_autograd(
        **_REFUSING_COMPILERS, decompositions={}, keep_inference_input_mutations=True
    )
    return _run_aot(snapshot, snapshot.gm, backend, "served from loom's cache")


def _compile_cold(
    parts: Pipeline, prepared: Prepared, session: CudagraphSession, run: CacheRun | None
) -> tuple[Compiled, _ColdCompilers]:
    """Loom's passes over Dynamo's graph, then AOTAutograd with loom's compilers."""
    snapshot = prepared.snapshot
    record, example_inputs = snapshot.record, snapshot.example_inputs
    inductor = snapshot.options.codegen == "inductor"
    with record.timed("pipeline"):
        gm = snapshot.gm
        with record.timed("hooks.order_tensor_hooks"):
            gm = order_tensor_hooks(record, gm)
        with record.timed("resize.rewrite_fills"):
            gm = rewrite_fills(snapshot, gm, prepared.resize)
        for dynamo_pass in parts.dynamo_passes:
            gm = dynamo_pass(gm)
        if inductor:
            with record.timed("inductor.pre_grad", owner="torch"):
                gm = compat.inductor_pre_grad_passes(gm, example_inputs)
        compilers = _ColdCompilers(parts, prepared, session, run, gm)
        backend = compat.aot_autograd(
            **compilers.as_kwargs(),
            decompositions=compat.inductor_decompositions() if inductor else {},
            keep_inference_input_mutations=True,
        )
        fn = _run_aot(snapshot, gm, backend, "trace, partition and forward codegen")
    return Compiled(fn, CompiledSource.COLD, compilers.placement), compilers


def _run_aot(
    snapshot: Snapshot, gm: GraphModule, backend: Callable[..., Any], detail: str
) -> Callable[..., Any]:
    """Run AOTAutograd's ``backend`` on ``gm``; a failure is a refusal (``AOT_FAILED``)."""
    options, record, example_inputs = snapshot.options, snapshot.record, snapshot.example_inputs
    try:
        with (
            record.timed("aot", detail, owner="torch"),
            compat.codegen_context(example_inputs),
            compat.inductor_config.patch(max_autotune=options.max_autotune),
        ):
            return backend(gm, example_inputs)  # type: ignore[no-any-return]
    except (LoomRefusal, CacheNotServed):
        raise
    except compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as err:  # AOTAutograd or codegen could not handle the graph
        error = cudagraph_error(err)
        if error is not None:  # cudagraph_or_error: a request to fail, not to fall back
            raise error from None
        if options.strict:
            raise
        raise LoomRefusal(
            Unsupported(
                RefusalKind.AOT_FAILED,
                _user_frame(gm),
                f"{type(err).__name__}: {err}",
                "run with TORCHLOOM_LOG=debug to see the graphs; strict=True raises here",
            )
        ) from err


def _refuse_to_compile(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a graph served from loom's cache compiles nothing")


_REFUSING_COMPILERS: Final = {
    "fw_compiler": _refuse_to_compile,
    "bw_compiler": _refuse_to_compile,
    "inference_compiler": _refuse_to_compile,
    "partition_fn": _refuse_to_compile,
}


def _partition(
    parts: Pipeline,
    prepared: Prepared,
    inductor: bool,
    joint: GraphModule,
    joint_inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> tuple[GraphModule, GraphModule, HookPlacement]:
    """AOTAutograd's partition step, then the saved-tensor hooks placed: the forward,
    the backward, and what the placement did."""
    snapshot = prepared.snapshot
    record = snapshot.record
    if graphs_log.isEnabledFor(logging.DEBUG):  # nothing runs the joint graph's code
        with record.timed("report.graphs"):
            _show(record, "joint", joint)
    with record.timed("partition", owner="torch"):
        if inductor:
            fw, bw = compat.inductor_partition(joint, joint_inputs, **kwargs)
        else:
            fw, bw = compat.eager_partition(joint, joint_inputs, **kwargs)
    with record.timed("hooks.place"):
        placement = place_hooks(
            snapshot,
            prepared.hooks,
            fw,
            bw,
            parts.place_saved_tensor_hooks,
            num_fwd_outputs=kwargs.get("num_fwd_outputs"),
            static_input_indices=kwargs.get("static_lifetime_input_indices") or (),
        )
    for partition_pass in parts.partition_passes:
        fw, bw = partition_pass(fw, bw)
    return fw, bw, placement


def _graph_passes(
    parts: Pipeline, snapshot: Snapshot, kind: GraphKind, g: GraphModule
) -> GraphModule:
    """Loom's passes over one aten graph, then the pipeline's extra ones."""
    record, options = snapshot.record, snapshot.options
    with record.timed("hooks.inline"):
        g = inline_hook_graphs(g)
    with record.timed("resize.passes"):
        g = resize_passes(record, options, g, kind)
    with record.timed("grad_hooks.inline"):
        g = inline_grad_hooks(snapshot, g, kind)
    for graph_pass in parts.graph_passes:
        g = graph_pass(kind, g)
    with record.timed("report.graphs"):
        _show(record, kind.value, g)
    return g


def _inductor_codegen(
    kwargs: Mapping[str, Any], g: GraphModule, inputs: Sequence[Any], static_idxs: Sequence[int]
) -> Callable[..., Any]:
    """Inductor's inner compile as a :data:`Codegen` (``kwargs``: what Inductor passed)."""
    kw = {**kwargs, "static_input_idxs": list(static_idxs)}
    return compat.inductor_compile_inner(g, inputs, **kw)  # type: ignore[no-any-return]


def _timed_codegen(
    record: GraphRecordBuilder,
    kind: GraphKind,
    codegen_name: str,
    base: Codegen,
    g: GraphModule,
    inputs: Sequence[Any],
    static_idxs: Sequence[int],
) -> Callable[..., Any]:
    with record.timed(f"codegen.{kind.value}", codegen_name, owner="torch"):
        return base(g, inputs, static_idxs)


class _ColdCompilers:
    """AOTAutograd's partition step and per-graph compilers for one cold compile:
    loom's passes on each aten graph, then the codegen choice.

    AOTAutograd calls them back one at a time, so this is the cold compile's one
    mutable object: ``placement`` is what :func:`_partition` returned (the compilers
    read it), ``compiled`` the aten graphs compiled so far, and ``after_backward``
    stores the cache entry once a lazily compiled backward is generated.
    """

    def __init__(
        self,
        parts: Pipeline,
        prepared: Prepared,
        session: CudagraphSession,
        run: CacheRun | None,
        gm: GraphModule,
    ) -> None:
        self.parts, self.prepared, self.session, self.run = parts, prepared, session, run
        self.snapshot = prepared.snapshot
        self.num_dynamo_inputs = len(self.snapshot.example_inputs)
        self.num_orig_outputs = compat.num_model_outputs(gm)
        self.inductor_state: compat.InductorCompileState | None = None
        if self.snapshot.options.codegen == "inductor":
            # Inductor's own set-up: every Inductor compile pays it, loom or not.
            with self.snapshot.record.timed("inductor.setup", owner="torch"):
                self.inductor_state = compat.InductorCompileState(gm)
        self.placement = HookPlacement()
        self.compiled: set[GraphKind] = set()
        self.after_backward: StoreAfterBackward | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "fw_compiler": functools.partial(self.compile, GraphKind.FORWARD),
            "bw_compiler": functools.partial(self.compile, GraphKind.BACKWARD),
            "inference_compiler": functools.partial(self.compile, GraphKind.INFERENCE),
            "partition_fn": self.partition,
        }

    def partition(self, joint: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        inductor = self.inductor_state is not None
        fw, bw, self.placement = _partition(
            self.parts, self.prepared, inductor, joint, joint_inputs, kwargs
        )
        return fw, bw

    def compile(self, kind: GraphKind, g: GraphModule, inputs: Sequence[Any]) -> Any:
        """One aten graph: loom's passes, then codegen (Inductor's wrappers around it);
        a forward whose hooks read values at each call takes them as its last inputs."""
        if kind is GraphKind.FORWARD:
            # NOTE: a compile-time choice, no per-call check: a backward served or
            # compiled here never raises for a retained graph (compat's docstring).
            compat.keep_saved_tensors()
        lifted = lifted_hook_inputs(self.placement, kind)
        if not lifted:
            return self._compile(kind, g, inputs)
        compiled = self._compile(kind, g, [*inputs, *lifted])
        return with_hook_values(compiled, self.placement, kind)

    def _compile(self, kind: GraphKind, g: GraphModule, inputs: Sequence[Any]) -> Any:
        snapshot = self.snapshot
        g = _graph_passes(self.parts, snapshot, kind, g)
        codegen = snapshot.options.codegen
        with snapshot.record.timed(f"compile.{kind.value}", codegen, owner="torch"):
            state = self.inductor_state
            if state is None:
                static = compat.static_input_indices(
                    kind is GraphKind.BACKWARD, g, inputs, self.num_dynamo_inputs
                )
                return self.finish(kind, g, inputs, static, self.parts.eager_codegen)
            inner = functools.partial(self.inductor_inner, kind)
            if kind is GraphKind.BACKWARD:
                return compat.inductor_compile_backward(state, g, inputs, inner_compile=inner)
            return compat.inductor_compile_forward(
                state,
                g,
                inputs,
                num_orig_model_outputs=self.num_orig_outputs,
                num_example_inputs=self.num_dynamo_inputs,
                is_inference=kind is GraphKind.INFERENCE,
                inner_compile=inner,
            )

    def inductor_inner(
        self, kind: GraphKind, g: GraphModule, inputs: Sequence[Any], **kwargs: Any
    ) -> Callable[..., Any]:
        """Inductor's inner compile: loom's codegen choice, Inductor's lowering as the base."""
        codegen = functools.partial(_inductor_codegen, kwargs)
        return self.finish(kind, g, inputs, kwargs.get("static_input_idxs", ()), codegen)

    def finish(
        self,
        kind: GraphKind,
        g: GraphModule,
        inputs: Sequence[Any],
        static_idxs: Sequence[int],
        base: Codegen,
    ) -> Callable[..., Any]:
        """Choose codegen: CUDA-graph segments, the cache's eager ``OutputCode``, or
        ``base`` on the whole graph; then the compiled graph's wrappers."""
        snapshot = self.snapshot
        record, options = snapshot.record, snapshot.options
        timed = functools.partial(_timed_codegen, record, kind, options.codegen, base)
        codegen = in_placement_order(timed, self.placement, kind, snapshot.graph_id)
        fn: Callable[..., Any] | None = None
        if options.cudagraphs:
            with record.timed("cudagraph.segments"):
                fn = compile_segmented(
                    self.session,
                    options,
                    self.parts.plan_graph,
                    g,
                    kind,
                    inputs,
                    static_idxs,
                    codegen,
                )
        if fn is None and self.run is not None and options.codegen == "eager":
            fn = EagerOutputCode(g)  # serializable, so eager compilations cache too
        if fn is None:
            fn = codegen(g, inputs, static_idxs)
        fn = with_unpack_effects(fn, self.prepared.hooks, self.placement, kind)
        fn = with_saved_strides(fn, self.prepared.hooks, self.placement, kind, g, inputs)
        for wrap in self.parts.compiled_wrappers:
            fn = wrap(kind, fn)
        self.compiled.add(kind)
        if kind is GraphKind.BACKWARD and self.after_backward is not None:
            store, self.after_backward = self.after_backward, None
            store()
        return fn


DEFAULT_PIPELINE = Pipeline()


# --- helpers --------------------------------------------------------------------------------


def input_metadata(example_inputs: Sequence[Any]) -> list[InputMeta]:
    metas = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            metas.append(
                InputMeta(
                    i,
                    "tensor",
                    str(x.dtype).removeprefix("torch."),
                    tuple(str(s) for s in x.shape),
                    tuple(str(s) for s in x.stride()) if x.layout == torch.strided else None,
                    str(x.device),
                    bool(x.requires_grad),
                )
            )
        elif isinstance(x, torch.SymInt):
            metas.append(InputMeta(i, "symint"))
        else:
            metas.append(InputMeta(i, type(x).__name__))
    return metas


def _has_tensor_work(gm: GraphModule) -> bool:
    return any(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def _show(record: GraphRecordBuilder, kind: str, gm: GraphModule) -> None:
    """Keep the graph's code in the report; with debug logging on, annotated with
    every value's shape, stride and device (rendering that costs more than a small
    graph's codegen, so it is not done otherwise)."""
    if graphs_log.isEnabledFor(logging.DEBUG):
        code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        graphs_log.debug("graph %d, %s:\n%s", record.graph_id, kind, code)
    else:
        code = gm.code
    record.add_graph(kind, code)


def _eager_fallback(
    record: GraphRecordBuilder, gm: GraphModule, reason: Unsupported
) -> Callable[..., Any]:
    record.refuse(reason)
    record.add_entry("pipeline", "fallback", str(reason), kind_=reason.kind.value, refusal=reason)
    if reason.kind is RefusalKind.NO_TENSOR_WORK:
        log.debug("graph %d runs eagerly: %s", record.graph_id, reason)
    else:
        log.warning("graph %d falls back to eager: %s", record.graph_id, reason)
    return gm.forward


def _user_frame(gm: GraphModule) -> str:
    """``file:line in fn`` of the user source line the graph's first node came from, if known."""
    for node in gm.graph.nodes:
        frame = user_frame(node.meta.get("stack_trace"))
        if frame is not None:
            return str(frame)
    return ""
