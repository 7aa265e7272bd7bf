"""The ``loom`` pipeline: Dynamo graph → AOTAutograd with torchloom's own
partition step and compilers → codegen per graph → runtime wrapper.

The pipeline itself knows no package: each takes part through a
:class:`~torchloom._stages.PipelineStage` in :data:`~torchloom._stages.STAGES`.
Every stage's work is timed into the graph's record behind
:func:`torchloom.report`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from torchloom import _torch_compat as compat
from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
from torchloom._log import get_logger
from torchloom._options import LoomOptions
from torchloom._report import InputMeta, Owner, new_record
from torchloom._stages import STAGES, Codegen, GraphContext, GraphKind

__all__ = ["compile_graph", "input_metadata"]

log = get_logger("pipeline")
graphs_log = get_logger("graphs")


def _timed(
    ctx: GraphContext, name: str, detail: str = "", owner: Owner = "loom"
) -> contextlib.AbstractContextManager[None]:
    return ctx.record.timed(name, detail, owner)


def _timed_call(
    ctx: GraphContext, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    with _timed(ctx, name):
        return fn(*args, **kwargs)


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


def _show(ctx: GraphContext, kind: str, gm: GraphModule) -> None:
    """Keep the graph's code in the report; with debug logging on, annotated with
    every value's shape, stride and device (rendering that costs more than a small
    graph's codegen, so it is not done otherwise)."""
    if graphs_log.isEnabledFor(logging.DEBUG):
        code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        graphs_log.debug("graph %d, %s:\n%s", ctx.graph_id, kind, code)
    else:
        code = gm.code
    ctx.record.add_graph(kind, code)


def _eager_fallback(ctx: GraphContext, gm: GraphModule, reason: Unsupported) -> Callable[..., Any]:
    ctx.record.fallback = str(reason)
    ctx.record.add_entry("pipeline", "fallback", str(reason), kind_=reason.kind.value)
    if reason.kind is RefusalKind.NO_TENSOR_WORK:
        log.debug("graph %d runs eagerly: %s", ctx.graph_id, reason)
    else:
        log.warning("graph %d falls back to eager: %s", ctx.graph_id, reason)
    return gm.forward


def compile_graph(
    gm: GraphModule, example_inputs: Sequence[Any], options: LoomOptions
) -> Callable[..., Any]:
    """Compile one Dynamo graph with the ``loom`` pipeline."""
    record = new_record(
        gm.meta.get("dynamo_compile_id", "graph").__str__(),
        input_metadata(example_inputs),
        options.as_dict(),
    )
    ctx = GraphContext(options, record, gm, example_inputs)
    with _timed(ctx, "report.graphs"):
        _show(ctx, "dynamo", gm)
    if not _has_tensor_work(gm):
        return _eager_fallback(
            ctx, gm, Unsupported(RefusalKind.NO_TENSOR_WORK, "", "the graph has no tensor work")
        )

    def cold() -> Callable[..., Any]:
        with _timed(ctx, "pipeline"):
            return _compile_cold(ctx, gm, example_inputs)

    compile_fn: Callable[[], Callable[..., Any]] = cold
    for stage in reversed(STAGES):
        compile_fn = functools.partial(
            _timed_call,
            ctx,
            f"{stage.name}.wrap_backend",
            stage.wrap_backend,
            ctx,
            example_inputs,
            compile_fn,
        )
    try:
        return compile_fn()
    except compat.CONTROL_FLOW_EXCEPTIONS as signal:
        # Not a refusal: Dynamo restarts (or skips) the frame and calls the backend again.
        ctx.record.add_entry(
            "pipeline", "restart", f"Dynamo asked to {type(signal).__name__}; not compiled here"
        )
        log.debug("graph %d: %s propagates to Dynamo", ctx.graph_id, type(signal).__name__)
        raise
    except LoomRefusal as refusal:
        if options.strict:
            raise
        return _eager_fallback(ctx, gm, refusal.reason)


def _compile_cold(
    ctx: GraphContext, gm: GraphModule, example_inputs: Sequence[Any]
) -> Callable[..., Any]:
    options = ctx.options
    for stage in STAGES:
        with _timed(ctx, f"{stage.name}.before_aot"):
            gm = stage.before_aot(ctx, gm, example_inputs)
    inductor = options.codegen == "inductor"
    num_dynamo_inputs = len(example_inputs)
    num_orig_outputs = compat.num_model_outputs(gm)
    inductor_state: compat.InductorCompileState | None = None
    decompositions: Any = {}
    if inductor:
        # Inductor's own import and set-up: every Inductor compile pays it, loom or not.
        with _timed(ctx, "inductor.setup", "import and configure Inductor", owner="torch"):
            inductor_state = compat.InductorCompileState()
            decompositions = compat.inductor_decompositions()

    if inductor:
        with _timed(ctx, "inductor.pre_grad", owner="torch"):
            gm = compat.inductor_pre_grad_passes(gm, example_inputs)

    def partition(joint: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if graphs_log.isEnabledFor(logging.DEBUG):  # nothing runs the joint graph's code
            with _timed(ctx, "report.graphs"):
                _show(ctx, "joint", joint)
        with _timed(ctx, "partition", owner="torch"):
            if inductor:
                fw, bw = compat.inductor_partition(joint, joint_inputs, **kwargs)
            else:
                fw, bw = compat.eager_partition(joint, joint_inputs, **kwargs)
        for stage in STAGES:
            with _timed(ctx, f"{stage.name}.after_partition"):
                fw, bw = stage.after_partition(ctx, fw, bw)
        return fw, bw

    def finish(
        kind: GraphKind,
        g: GraphModule,
        inputs: Sequence[Any],
        static_idxs: Sequence[int],
        codegen: Codegen,
    ) -> Callable[..., Any]:
        base = codegen

        def timed_codegen(
            g3: GraphModule, inputs3: Sequence[Any], static3: Sequence[int]
        ) -> Callable[..., Any]:
            with _timed(ctx, f"codegen.{kind.value}", options.codegen, owner="torch"):
                return base(g3, inputs3, static3)

        codegen = timed_codegen
        for stage in STAGES:
            codegen = stage.wrap_codegen(ctx, g, kind, codegen)
        fn: Callable[..., Any] | None = None
        for stage in STAGES:
            fn = _timed_call(
                ctx,
                f"{stage.name}.compile",
                stage.compile,
                ctx,
                g,
                kind,
                inputs,
                static_idxs,
                codegen,
            )
            if fn is not None:
                break
        if fn is None:
            fn = codegen(g, inputs, static_idxs)
        for stage in STAGES:
            fn = _timed_call(
                ctx, f"{stage.name}.wrap_compiled", stage.wrap_compiled, ctx, fn, g, kind, inputs
            )
        return fn

    def compiler(kind: GraphKind, g: GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        for stage in STAGES:
            g = _timed_call(
                ctx, f"{stage.name}.before_codegen", stage.before_codegen, ctx, g, kind, inputs
            )
        with _timed(ctx, "report.graphs"):
            _show(ctx, kind.value, g)
        with _timed(ctx, f"compile.{kind.value}", options.codegen, owner="torch"):
            if inductor_state is None:
                static = compat.static_input_indices(
                    kind is GraphKind.BACKWARD, g, inputs, num_dynamo_inputs
                )
                return finish(kind, g, inputs, static, _eager_codegen)

            def inner(g2: GraphModule, inputs2: Sequence[Any], **kwargs: Any) -> Any:
                def codegen(
                    g3: GraphModule, inputs3: Sequence[Any], static_idxs: Sequence[int]
                ) -> Callable[..., Any]:
                    kw = {**kwargs, "static_input_idxs": list(static_idxs)}
                    return compat.inductor_compile_inner(g3, inputs3, **kw)  # type: ignore[no-any-return]

                return finish(kind, g2, inputs2, kwargs.get("static_input_idxs", ()), codegen)

            if kind is GraphKind.BACKWARD:
                return compat.inductor_compile_backward(  # type: ignore[no-any-return]
                    inductor_state, g, inputs, inner_compile=inner
                )
            return compat.inductor_compile_forward(  # type: ignore[no-any-return]
                inductor_state,
                g,
                inputs,
                num_orig_model_outputs=num_orig_outputs,
                num_example_inputs=num_dynamo_inputs,
                is_inference=kind is GraphKind.INFERENCE,
                inner_compile=inner,
            )

    backend = compat.aot_autograd(
        fw_compiler=functools.partial(compiler, GraphKind.FORWARD),
        bw_compiler=functools.partial(compiler, GraphKind.BACKWARD),
        inference_compiler=functools.partial(compiler, GraphKind.INFERENCE),
        partition_fn=partition,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )
    try:
        with (
            _timed(ctx, "aot", "trace, partition and forward codegen", owner="torch"),
            compat.codegen_context(example_inputs),
            compat.inductor_config.patch(max_autotune=options.max_autotune),
        ):
            compiled = backend(gm, example_inputs)
    except LoomRefusal:
        raise
    except compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as err:  # AOTAutograd or codegen could not handle the graph
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
    for stage in STAGES:
        compiled = _timed_call(ctx, f"{stage.name}.wrap_runtime", stage.wrap_runtime, ctx, compiled)
    return compiled


def _user_frame(gm: GraphModule) -> str:
    """file:line of the user source line the graph's first node came from, if known."""
    for node in gm.graph.nodes:
        match = _FRAME.findall(node.meta.get("stack_trace") or "")
        if match:
            path, line = match[-1]
            return f"{path}:{line}"
    return ""


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _eager_codegen(
    gm: GraphModule, example_inputs: Sequence[Any], static_input_idxs: Sequence[int]
) -> Callable[..., Any]:
    return compat.boxed_graph_callable(gm)
