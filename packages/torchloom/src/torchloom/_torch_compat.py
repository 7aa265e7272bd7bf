"""The umbrella's only door to private torch APIs (pinned: torch 2.11).

Everything below ``torch._*`` that the pipeline uses is imported or wrapped
here, so a torch upgrade is a diff of this file. Sections are grouped by the
stage that needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._dynamo.backends.registry import register_backend as _register_backend
from torch._dynamo.exc import RestartAnalysis, ShortenTraceback, SkipFrame
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._inductor.output_code import OutputCode as _OutputCode
from torch._inductor.utils import BoxedBool
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule

__all__ = [
    "CONTROL_FLOW_EXCEPTIONS",
    "AotCacheSlot",
    "BoxedBool",
    "EagerOutputCode",
    "aot_autograd",
    "aot_cache_slot",
    "backend_registered",
    "boxed_graph_callable",
    "caches_force_disabled",
    "codegen_context",
    "dynamo_frame_code",
    "dynamo_reset",
    "eager_partition",
    "inductor_compile_backward",
    "inductor_compile_forward",
    "inductor_compile_inner",
    "inductor_config",
    "inductor_decompositions",
    "inductor_partition",
    "inductor_pre_grad_passes",
    "lazy_backward_lowering",
    "mark_boxed",
    "num_model_outputs",
    "register_backend",
    "route_lazy_backward_save",
    "static_input_indices",
]

#: What Dynamo and AOTAutograd raise to steer a compilation rather than to
#: report a failure: restart the analysis (``TensorifyScalarRestartAnalysis``
#: when a float input must be specialized under ``dynamic=True``, and the other
#: ``RestartAnalysis`` kinds), skip the frame, shorten a traceback. Dynamo
#: catches them around the backend call; a backend that turns one into a
#: fallback hides the restart and runs the frame eagerly for good.
CONTROL_FLOW_EXCEPTIONS: tuple[type[BaseException], ...] = (
    RestartAnalysis,
    SkipFrame,
    ShortenTraceback,
)


def _compile_fx() -> Any:
    """``torch._inductor.compile_fx``, imported on first use: it pulls in Inductor's
    lowerings and autotuning (seconds of import), which eager codegen never needs."""
    import torch._inductor.compile_fx as compile_fx

    return compile_fx


# --- AOTAutograd ---------------------------------------------------------------------------


def aot_autograd(**kwargs: Any) -> Callable[[GraphModule, Sequence[Any]], Callable[..., Any]]:
    """``torch._dynamo.backends.common.aot_autograd``: AOTAutograd with our compilers.

    It wraps the backward compiler and the compiled backward in
    ``torch._dynamo.disable`` so Dynamo never traces either.
    """
    return _aot_autograd(**kwargs)  # type: ignore[no-any-return]


def eager_partition(gm: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Min-cut partition without Inductor's joint-graph passes (eager codegen)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)


@contextlib.contextmanager
def codegen_context(example_inputs: Sequence[Any]) -> Iterator[None]:
    """The context ``compile_fx`` sets around AOTAutograd: fake mode, tracing
    context, compiled autograd off, effect tokens unlifted."""
    from torch._dynamo import compiled_autograd

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    ctx = TracingContext.try_get() or TracingContext(fake_mode)
    with (
        V.set_fake_mode(fake_mode),
        tracing(ctx),
        compiled_autograd._disable(),
        functorch_config.patch(unlift_effect_tokens=True),
    ):
        yield


# --- Inductor codegen ----------------------------------------------------------------------


def inductor_decompositions() -> Any:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_pre_grad_passes(gm: GraphModule, example_inputs: Sequence[Any]) -> GraphModule:
    return _compile_fx().run_pre_grad_passes(gm, example_inputs)  # type: ignore[no-any-return]


def inductor_partition(gm: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's partition step: joint-graph passes, then min-cut rematerialization."""
    return _compile_fx().partition_fn(gm, joint_inputs, **kwargs)


class InductorCompileState:
    """Per-Dynamo-graph state Inductor threads through forward and backward."""

    def __init__(self) -> None:
        self.extra = _compile_fx().create_compiler_config_extra(inductor_config)


def inductor_compile_inner(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's per-graph compiler, with Inductor's own CUDA graphs off
    (loom's runtime owns CUDA graphs)."""
    kwargs["cudagraphs"] = BoxedBool(False)
    return _compile_fx().compile_fx_inner(gm, example_inputs, **kwargs)


def inductor_compile_forward(
    state: InductorCompileState,
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    num_orig_model_outputs: int,
    num_example_inputs: int,
    is_inference: bool,
    inner_compile: Callable[..., Any],
) -> Any:
    return _compile_fx().compile_fx_forward(
        gm,
        example_inputs,
        num_orig_model_outputs=num_orig_model_outputs,
        num_example_inputs=num_example_inputs,
        compiler_config_extra=state.extra,
        inner_compile=inner_compile,
        is_inference=is_inference,
    )


def inductor_compile_backward(
    state: InductorCompileState,
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    inner_compile: Callable[..., Any],
) -> Any:
    return _compile_fx().compile_fx_backward(
        gm, example_inputs, compiler_config_extra=state.extra, inner_compile=inner_compile
    )


def num_model_outputs(gm: GraphModule) -> int:
    """What ``compile_fx.get_num_model_outputs`` counts: the output node's leaves."""
    import torch.utils._pytree as pytree

    return len(pytree.arg_tree_leaves(*gm.graph.output_node().args))


# --- Dynamo --------------------------------------------------------------------------------


def dynamo_reset() -> None:
    torch._dynamo.reset()


def register_backend(name: str, fn: Callable[..., Any]) -> None:
    _register_backend(compiler_fn=fn, name=name)


def dynamo_frame_code() -> tuple[types.CodeType, int] | None:
    """The code object of the frame Dynamo is compiling now, and how many compiled
    entries Dynamo holds for it (none after ``torch._dynamo.reset()``); ``None``
    outside a Dynamo compile."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)
    code = getattr(tx, "f_code", None)
    if not isinstance(code, types.CodeType):
        return None
    return code, len(_debug_get_cache_entry_list(code))


def backend_registered(name: str) -> bool:
    from torch._dynamo.backends.registry import list_backends

    return name in list_backends(exclude_tags=())


# --- eager codegen and static inputs -------------------------------------------------------


def mark_boxed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as taking its inputs as one list that it may clear
    (AOTAutograd's boxed calling convention, read off ``_boxed_call``)."""
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def boxed_graph_callable(gm: GraphModule) -> Callable[[list[Any]], Any]:
    """Run ``gm`` eagerly with the boxed convention: the generated code takes the
    argument list and clears it, so inputs die as early as they would in eager."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())  # type: ignore[no-untyped-call]
    gm.recompile()
    fn: Any = gm.forward
    runner: Any = lambda args: fn(args)  # noqa: E731
    runner._boxed_call = True
    return runner  # type: ignore[no-any-return]


def static_input_indices(
    is_backward: bool, gm: GraphModule, example_inputs: Sequence[Any], num_dynamo_inputs: int
) -> list[int]:
    """Inputs with fixed addresses (parameters, buffers), as Inductor computes them."""
    from torch._inductor.utils import count_tangents, num_fw_fixed_arguments

    if is_backward:
        return list(range(count_tangents(gm)))
    fixed = num_fw_fixed_arguments(num_dynamo_inputs, len(example_inputs))
    # As ``compile_fx.get_static_input_idxs``: AOTAutograd's static inputs when it
    # recorded them (parameters and buffers inlined as inputs), else the fixed ones.
    context = TracingContext.try_get()
    if context is None or not context.fw_metadata:
        return list(range(fixed))
    return list(context.fw_metadata.static_input_indices)


# --- loom cache: AOTAutograd's result slots ------------------------------------------------
#
# PyTorch's AOTAutogradCache only serves Inductor's own compiler. The cache stage reuses its
# machinery for loom's compilers: during one compilation, AOTAutograd's try_load / make_entry /
# save slots are routed to an AotCacheSlot, so a miss captures the bundled result (runtime
# metadata, wrappers, serialized compiled forward/backward) and a hit rebuilds the runtime
# from it without tracing, partitioning or codegen. Nothing reaches PyTorch's own cache.


@dataclasses.dataclass
class AotCacheSlot:
    """One compilation's exchange with AOTAutograd's cache slots.

    ``load``: a pickled result to serve (a hit), or ``None``. After the
    compilation: ``loaded`` says whether it was served; ``load_error`` why not;
    ``saved`` holds the pickled result of a cold compilation, ``save_error`` why
    there is none; ``save_attempted`` is false while AOTAutograd has not tried to
    save yet (its backward is compiled lazily, at the first backward).
    """

    key: str
    load: bytes | None = None
    loaded: bool = False
    load_error: str | None = None
    saved: bytes | None = None
    save_error: str | None = None
    save_attempted: bool = False


class EagerOutputCode(_OutputCode):
    """A boxed eager graph as an Inductor ``OutputCode``, so AOTAutograd can bundle
    an eager-codegen result like an Inductor one. It runs exactly as
    :func:`boxed_graph_callable`; pickling stores a copy of its graph with the
    standard code generator and no metadata."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__()
        # An instance attribute: wrappers (functools.wraps) copy __dict__ only.
        self._boxed_call = True
        self.gm = gm
        self._fn: Callable[[list[Any]], Any] | None = boxed_graph_callable(gm)

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._fn is None:
            self._fn = boxed_graph_callable(self.gm)
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


@contextlib.contextmanager
def aot_cache_slot(slot: AotCacheSlot) -> Iterator[None]:
    """Route AOTAutograd's cache slots to ``slot`` for the compilation inside.

    The backward is compiled now, so that the entry is complete when the
    compilation returns, unless :func:`lazy_backward_lowering` says otherwise
    inside; then see :func:`route_lazy_backward_save`.
    """
    with (
        _routed_to(slot, serve=True),
        functorch_config.patch(force_non_lazy_backward_lowering=True),
    ):
        yield


def lazy_backward_lowering() -> contextlib.AbstractContextManager[None]:
    """Inside :func:`aot_cache_slot`: compile the backward at its first call after all
    (AOTAutograd then makes and saves the entry right after that compile)."""
    return functorch_config.patch(force_non_lazy_backward_lowering=False)  # type: ignore[no-any-return]


def route_lazy_backward_save(slot: AotCacheSlot, saved: Callable[[], None]) -> Callable[[], None]:
    """Route the entry AOTAutograd saves after a lazily compiled backward to ``slot``.

    Call it from the backward compiler (AOTAutograd makes and saves the entry
    right after it returns); ``saved()`` runs once the slot holds the result (or
    ``save_error``). Returns a function that undoes the routing if no save came.
    """
    while _armed:  # a backward compile that raised after arming never saved
        _armed[-1]()
    stack = contextlib.ExitStack()

    def finish() -> None:
        if finish in _armed:
            _armed.remove(finish)
            stack.close()

    def on_save() -> None:
        finish()
        saved()

    stack.enter_context(_routed_to(slot, serve=False, on_save=on_save))
    _armed.append(finish)
    return finish


_armed: list[Callable[[], None]] = []


@contextlib.contextmanager
def _routed_to(
    slot: AotCacheSlot, *, serve: bool, on_save: Callable[[], None] | None = None
) -> Iterator[None]:
    """AOTAutograd's try_load (with ``serve``), make_entry and save slots, routed to ``slot``."""
    import pickle
    import time

    from torch._functorch._aot_autograd import autograd_cache as ac
    from torch._functorch._aot_autograd.schemas import AOTAutogradCacheInfo
    from torch.fx.experimental.symbolic_shapes import size_hint

    cache = ac.AOTAutogradCache
    original_make_entry = cache.make_entry

    def try_load(
        mod: Any,
        args: list[Any],
        aot_config: Any,
        cudagraphs: Any,
        boxed_forward_device_index: Any,
        local: bool,
        remote: bool,
    ) -> Any:
        symints = cache._filter_backed_symints(args)
        if slot.load is not None:
            try:
                entry = pickle.loads(slot.load)
                guards = entry.guards_expr
                if guards and not cache.evaluate_guards(guards, [size_hint(s) for s in symints]):
                    raise LookupError(f"shape guards of the stored entry fail: {guards}")
                fx_config = {
                    "cudagraphs": cudagraphs,
                    "boxed_forward_device_index": boxed_forward_device_index,
                }
                compiled = entry.wrap_post_compile(args, aot_config, fx_config)
                slot.loaded = True
                return compiled
            except CONTROL_FLOW_EXCEPTIONS:
                raise
            except Exception as err:  # a bad entry is a miss, never a failed compile
                slot.load_error = f"{type(err).__name__}: {err}"
        aot_config.cache_info = AOTAutogradCacheInfo(slot.key, time.time_ns(), symints)
        return None

    def make_entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_make_entry(*args, **kwargs)
        except Exception as err:
            slot.save_error = f"the compiled graphs are not serializable: {err}"
            return None

    def save(key: str, entry: Any, remote: bool) -> None:
        if key != slot.key:
            return
        slot.save_attempted = True
        try:
            if entry is not None:
                entry.pre_save()
                slot.saved = pickle.dumps(entry)
        except Exception as err:
            slot.save_error = f"{type(err).__name__}: {err}"
        if on_save is not None:
            on_save()

    saved_attrs = {name: cache.__dict__[name] for name in ("try_load", "make_entry", "save")}
    try:
        if serve:
            cache.try_load = staticmethod(try_load)  # type: ignore[method-assign,assignment]
        cache.make_entry = staticmethod(make_entry)  # type: ignore[method-assign,assignment]
        cache.save = staticmethod(save)  # type: ignore[method-assign,assignment]
        with functorch_config.patch(
            force_autograd_cache=True, bundled_autograd_cache=True, enable_autograd_cache=True
        ):
            yield
    finally:
        for name, value in saved_attrs.items():
            setattr(cache, name, value)


def caches_force_disabled() -> bool:
    """``torch.compiler.config.force_disable_caches`` (loom's cache honours it)."""
    return bool(torch.compiler.config.force_disable_caches)


# --- loom cudagraph: segment codegen inside one AOT graph -----------------------------------


def graph_output_strides(gm: GraphModule) -> list[Any]:
    """The traced strides of ``gm``'s outputs (``None`` for non-tensors and unbacked strides)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    outs = gm.graph.output_node().args[0]
    result: list[Any] = []
    for out in outs if isinstance(outs, list | tuple) else (outs,):
        val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and not free_unbacked_symbols(val.stride()):
            result.append(tuple(val.stride()))
        else:
            result.append(None)
    return result


@contextlib.contextmanager
def segment_codegen_strides(gm: GraphModule) -> Iterator[Callable[[GraphModule], None]]:
    """Let Inductor compile several segments of ``gm`` inside one AOT graph.

    Inductor hands each compiled graph's output strides to AOTAutograd through
    ``TracingContext.output_strides`` and asserts the list is empty first. The
    yielded callable, called with each segment before its codegen, empties it
    and marks every segment output user-visible with its traced strides, so
    Inductor neither pads nor reorders what the next segment reads (it asserts
    its inputs' strides). On exit the list holds the strides of ``gm``'s outputs.
    """
    ctx = TracingContext.try_get()
    strides = ctx.output_strides if ctx is not None else None

    def before_segment(seg: GraphModule) -> None:
        if strides is not None:
            strides.clear()
        node = seg.graph.output_node()
        seg_strides = graph_output_strides(seg)
        node.meta["original_output_strides"] = seg_strides
        node.meta["user_visible_output_idxs"] = [
            i for i, st in enumerate(seg_strides) if st is not None
        ]

    yield before_segment
    if strides is not None:
        strides.clear()
        strides.extend(graph_output_strides(gm))


class SegmentedOutputCode(_OutputCode):
    """A graph compiled as separately generated segments, run by a runtime that
    ``factory(self)`` builds (loom's CUDA-graph runtime), as an Inductor
    ``OutputCode`` so that AOTAutograd can bundle it into loom's cache.

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
        self._boxed_call = True
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
        from copy import copy

        self.segments = [copy(s) for s in self.segments]
        for s in self.segments:
            if isinstance(s, _OutputCode):
                s.prepare_for_serialization()

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        if self.runtime is not None:
            return  # a cold compile: the segments ran their own post-compile steps
        from torch._inductor.codecache import FxGraphCache
        from torch._inductor.output_code import CompiledFxGraph

        ctx = TracingContext.try_get()
        strides = ctx.output_strides if ctx is not None else None
        kwargs = {
            **dict(graph_kwargs or {}),
            "cudagraphs": BoxedBool(False),
            "is_backward": self.is_backward,
            "is_inference": self.is_inference,
        }
        loaded = []
        for seg in self.segments:
            if isinstance(seg, CompiledFxGraph):
                graph, _ = FxGraphCache.cache_hit_post_compile(seg, {}, constants)
                if graph is None:
                    raise RuntimeError("could not reload a cached CUDA-graph segment")
                if strides is not None:
                    strides.clear()
                graph.post_compile(example_inputs, constants, kwargs)  # type: ignore[arg-type]
                seg = graph
            loaded.append(seg)
        self.segments = loaded
        if strides is not None:
            strides.clear()
            strides.extend(self.output_strides)
        # Now, inside the compilation: the factory joins the runtime to the graph
        # being compiled (its memory pool and report).
        self.runtime = self.factory(self)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "runtime": None, "pool": None}
