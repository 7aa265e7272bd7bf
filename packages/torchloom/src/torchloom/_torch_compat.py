"""The umbrella's only door to private torch APIs (pinned: torch 2.11).

Everything below ``torch._*`` that the pipeline uses is imported or wrapped
here, so a torch upgrade is a diff of this file: version-dependent names and
small adapters, no behaviour (the cache-slot routing lives in ``_aot_cache``,
the ``OutputCode`` subclasses in ``_output_code``). Sections are grouped by the
step that needs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
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
    "BoxedBool",
    "OutputCode",
    "aot_autograd",
    "aot_cache_info",
    "aot_try_load_slot",
    "autograd_cache",
    "autograd_cache_forced",
    "backed_symints",
    "backend_registered",
    "backward_lowering",
    "boxed_graph_callable",
    "caches_force_disabled",
    "codegen_context",
    "dynamo_frame_code",
    "dynamo_reset",
    "eager_partition",
    "entry_guards_hold",
    "fake_outputs_of",
    "fakify_first_call",
    "graph_output_strides",
    "import_inductor_runtime",
    "inductor_compile_backward",
    "inductor_compile_forward",
    "inductor_compile_inner",
    "inductor_config",
    "inductor_decompositions",
    "inductor_partition",
    "inductor_pre_grad_passes",
    "is_fake_call",
    "keep_saved_tensors",
    "mark_boxed",
    "num_model_outputs",
    "publish_entry_fw_metadata",
    "register_backend",
    "reload_inductor_segment",
    "segment_codegen_strides",
    "static_input_indices",
    "tracing_output_strides",
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


def _first_parameter(fn: Callable[..., Any]) -> str:
    return next(iter(inspect.signature(fn).parameters), "")


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
    """Per-Dynamo-graph state Inductor threads through forward and backward.

    torch 2.11 and 2.12 build it from Inductor's config module; 2.13 and later
    from the Dynamo graph (its ``cudagraph_annotation`` meta) and the config.
    """

    def __init__(self, gm: GraphModule) -> None:
        make = _compile_fx().create_compiler_config_extra
        from_graph = _first_parameter(make) == "gm"  # 2.13+
        self.extra = make(gm) if from_graph else make(inductor_config)


def warm_compile_workers(example_inputs: Sequence[Any]) -> None:
    """Wake Inductor's compile-worker pool for GPU inputs, as ``compile_fx`` does on
    entry (``AsyncCompile.wakeup``), before AOTAutograd traces.

    Triton kernels compile in the pool only once it is ready, in the main process
    one at a time until then: a pool first asked for by the first kernel is late
    for most of a cold compile's kernels. CPU inputs start nothing (C++ kernels
    compile on threads; ``compile_fx`` starts no pool for them either).
    """
    if any(
        isinstance(x, torch.Tensor) and x.device.type in ("cuda", "xpu") for x in example_inputs
    ):
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.wakeup()


def import_inductor_runtime() -> None:
    """Import what every module Inductor generates imports when it loads:
    ``select_algorithm`` (its ``extern_kernels``), and through it Inductor's lowering,
    kernel templates and, on GPU, Triton's codegen.

    ``torch.compile(backend="inductor")`` imports all of it at ``torch.compile()``
    (Dynamo calls ``get_compiler_config()``, which imports ``compile_fx``); any other
    backend is only looked up there, and the first generated module's load imports it,
    inside the first call.
    """
    import torch._inductor.select_algorithm  # noqa: F401


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


# --- loom cache: AOTAutograd's cache slots (used by torchloom._aot_cache) ----------------


def autograd_cache() -> Any:
    """``torch._functorch._aot_autograd.autograd_cache.AOTAutogradCache`` (imported on use)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache as cache

    return cache


def backed_symints(args: Sequence[Any]) -> list[Any]:
    """The backed SymInts among AOTAutograd's flat arguments (what its guards read)."""
    return autograd_cache()._filter_backed_symints(args)  # type: ignore[no-any-return]


def entry_guards_hold(guards: str, symints: Sequence[Any]) -> bool:
    """Whether a stored AOTAutograd entry's shape guards hold for ``symints``.

    The hints are what AOTAutograd's own lookup passes: ``size_hint`` on 2.11 and
    2.12, ``guarding_hint_or_throw`` on 2.13 and later (``size_hint`` is gone).
    """
    from torch.fx.experimental import symbolic_shapes

    hint: Callable[[Any], Any] = getattr(
        symbolic_shapes, "guarding_hint_or_throw", None
    ) or getattr(symbolic_shapes, "size_hint")  # noqa: B009
    return bool(autograd_cache().evaluate_guards(guards, [hint(s) for s in symints]))


def aot_cache_info(key: str, symints: Sequence[Any]) -> Any:
    """The ``AOTAutogradCacheInfo`` that makes AOTAutograd save its entry under ``key``."""
    import time

    from torch._functorch._aot_autograd.schemas import AOTAutogradCacheInfo

    return AOTAutogradCacheInfo(key, time.time_ns(), list(symints))


#: ``load(args, aot_config, fx_config)``: a compiled callable served from loom's cache, or ``None``.
AotLoad = Callable[[list[Any], Any, dict[str, Any]], Any]


def aot_try_load_slot(key: str, load: AotLoad) -> Callable[..., Any]:
    """A replacement for ``AOTAutogradCache.try_load`` that serves from ``load``.

    On a miss it tags the AOT config with ``key`` so that AOTAutograd saves its
    entry under it. The slot's calling convention differs by release:

    - 2.11, 2.12: ``try_load(mod, args, aot_config, cudagraphs,
      boxed_forward_device_index, local, remote) -> compiled | None``; the config
      is mutable and tagged in place.
    - 2.13 and later: ``try_load(mod, args, aot_config, compiler_config_extra,
      local, remote, [act_input_paths,] compile_region_name=...) -> (compiled |
      None, aot_config)``; the config is frozen, a tagged copy is returned.
    """
    from torch._functorch._aot_autograd import autograd_cache as module

    if not hasattr(module, "create_fx_config"):  # 2.11, 2.12

        def try_load_211(
            mod: Any,
            args: list[Any],
            aot_config: Any,
            cudagraphs: Any,
            boxed_forward_device_index: Any,
            local: bool,
            remote: bool,
        ) -> Any:
            fx_config = {
                "cudagraphs": cudagraphs,
                "boxed_forward_device_index": boxed_forward_device_index,
            }
            compiled = load(args, aot_config, fx_config)
            if compiled is None:
                aot_config.cache_info = aot_cache_info(key, backed_symints(args))
            return compiled

        return try_load_211

    def try_load(
        mod: Any,
        args: list[Any],
        aot_config: Any,
        compiler_config_extra: Any,
        local: bool,
        remote: bool,
        *rest: Any,
        compile_region_name: str | None = None,
    ) -> tuple[Any, Any]:
        make_fx_config: Any = getattr(module, "create_fx_config")  # noqa: B009  (2.13+ only)
        fx_config = dict(make_fx_config(compiler_config_extra, compile_region_name))
        compiled = load(args, aot_config, fx_config)
        if compiled is not None:
            return compiled, aot_config
        info = aot_cache_info(key, backed_symints(args))
        return None, dataclasses.replace(aot_config, cache_info=info)

    return try_load


def publish_entry_fw_metadata(entry: Any) -> None:
    """Leave a stored AOTAutograd entry's forward metadata on the tracing context, as a
    cold compile does (``graph_compile``: ``tracing_context.fw_metadata = ...``).

    Dynamo's DDP optimizer reads ``TracingContext.fw_metadata`` after each bucket's
    compile that went through AOTAutograd and asserts it is set.
    """
    ctx = TracingContext.try_get()
    if ctx is None:
        return
    subclass_meta = getattr(entry, "maybe_subclass_meta", None)
    ctx.fw_metadata = entry.runtime_metadata if subclass_meta is None else subclass_meta.fw_metadata


# --- Dynamo's DDP optimizer: the first call on fake tensors ---------------------------------


def fakify_first_call() -> bool:
    """``TracingContext.fakify_first_call``: Dynamo's DDP optimizer set it around this
    compile and will call the compiled graph once on fake tensors, expecting fake
    outputs (``torch/_dynamo/backends/distributed.py``, ``SubmodCompiler.run_node``).
    AOTAutograd answers that call in ``FakifiedOutWrapper`` on a cold compile only:
    a result served from a cache has no such wrapper (PyTorch's own cache bypasses
    itself while the flag is set)."""
    ctx = TracingContext.try_get()
    return bool(ctx is not None and ctx.fakify_first_call)


def is_fake_call(args: Sequence[Any]) -> bool:
    """Whether a call's tensor arguments include a fake tensor (the DDP optimizer's call)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(a, FakeTensor) for a in args)


def fake_outputs_of(gm: GraphModule, args: Sequence[Any]) -> Any:
    """``gm`` run on fake ``args``, its parameters and buffers fakified first, as the
    DDP optimizer runs a bucket that did not go through AOTAutograd
    (``deepcopy_to_fake_tensor``, real parameters allowed): fake outputs with
    eager strides, which Inductor keeps for graph outputs (``keep_output_stride``)."""
    from unittest import mock

    from torch._dynamo.utils import deepcopy_to_fake_tensor

    fake_mode = detect_fake_mode(args)
    if fake_mode is None:
        raise AssertionError("fake_outputs_of: no fake tensor among the arguments")
    with fake_mode, mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
        fake_gm = deepcopy_to_fake_tensor(gm, fake_mode)
        return fake_gm(*args)


def autograd_cache_forced() -> contextlib.AbstractContextManager[None]:
    """AOTAutograd's cache on (bundled), whatever the user's settings: the slots are loom's."""
    return functorch_config.patch(  # type: ignore[no-any-return]
        force_autograd_cache=True, bundled_autograd_cache=True, enable_autograd_cache=True
    )


def backward_lowering(*, lazy: bool) -> contextlib.AbstractContextManager[None]:
    """Compile the backward at its first call (``lazy``) or with the forward."""
    return functorch_config.patch(force_non_lazy_backward_lowering=not lazy)  # type: ignore[no-any-return]


def keep_saved_tensors() -> None:
    """Inside AOTAutograd's forward compile: the backward donates no saved tensor, so it
    may run with ``retain_graph`` or ``create_graph`` (``jacobian``, two ``autograd.grad``
    over one forward, a gradient penalty).

    AOTAutograd picks the donated buffers (saved tensors that alias no input or output)
    before the forward compile, into ``fw_metadata.bw_donated_idxs``: one list that the
    tracing context's metadata shares with the one its runtime checks (it raises on a
    retained backward when the list is not empty) and that Inductor's backward reads (it
    reuses their memory). PyTorch empties it only when the backward is compiled lazily
    inside a first backward that retains its graph; loom compiles the backward with the
    forward, so it empties the list here, in place.
    """
    ctx = TracingContext.try_get()
    donated = getattr(ctx.fw_metadata, "bw_donated_idxs", None) if ctx is not None else None
    if donated:
        donated.clear()


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


#: Inductor's compiled-graph base class: AOTAutograd bundles its subclasses into a cache
#: entry (loom's ``EagerOutputCode`` and ``SegmentedOutputCode``, in torchloom._output_code).
OutputCode = _OutputCode


def tracing_output_strides() -> list[Any] | None:
    """``TracingContext.output_strides`` of the compilation in progress, if any."""
    ctx = TracingContext.try_get()
    return ctx.output_strides if ctx is not None else None


def reload_inductor_segment(
    seg: Any, example_inputs: Any, constants: Any, graph_kwargs: dict[str, Any]
) -> Any:
    """A cached Inductor segment made runnable again as Inductor's own cache does
    (``None`` if it cannot be); any other segment is returned as it is."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraph

    if not isinstance(seg, CompiledFxGraph):
        return seg
    graph, _ = FxGraphCache.cache_hit_post_compile(seg, {}, constants)
    if graph is None:
        return None
    strides = tracing_output_strides()
    if strides is not None:
        strides.clear()
    graph.post_compile(example_inputs, constants, graph_kwargs)  # type: ignore[arg-type]
    return graph
