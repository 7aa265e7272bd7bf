"""``trace_hook``: turn a plain Python hook into a ``TracedHook`` or a ``HookUnsupported``."""

from __future__ import annotations

import dis
import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from loom_sidefx import ArgSource, ObjectSource, compile_guards

from . import (
    _ops_arith,  # noqa: F401  (registers handlers)
    _ops_call,  # noqa: F401
    _ops_control,  # noqa: F401
    _ops_load_store,  # noqa: F401
    _ops_stack,  # noqa: F401
    _torch_compat,
)
from ._context import TraceContext
from ._fingerprint import compute_fingerprint
from ._frame import HANDLERS, inline_call, make_root_function
from ._pyversion import BYTECODE_KNOWN, KNOWN_PYTHONS, PY_VERSION
from ._refusal import HookUnsupported, Refused, TraceRefusalKind, refuse
from ._traced import TracedHook

log = logging.getLogger("torchloom.hops.tracer")

DEFAULT_MAX_DEPTH = 16


def trace_hook(
    fn: Any, example_args: Sequence[Any], *, max_depth: int = DEFAULT_MAX_DEPTH
) -> TracedHook | HookUnsupported:
    """Trace ``fn(*example_args)`` symbolically; tensors in the arguments may be real or fake.

    >>> def pack(t):                                # doctest: +SKIP
    ...     return (t.dtype, t.to(torch.bfloat16))
    >>> traced = trace_hook(pack, (torch.randn(4),))  # doctest: +SKIP
    """
    func = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if not isinstance(func, types.FunctionType):
        return HookUnsupported(
            TraceRefusalKind.UNSUPPORTED_CALL,
            "<hook>",
            f"the hook is a {type(fn).__qualname__}, not a Python function or method",
            "pass a plain function (wrap callables in a def)",
        )
    if not BYTECODE_KNOWN:
        return unsupported_python(func.__code__)
    ctx = TraceContext(_fake_mode_for(example_args), max_depth=max_depth)
    ctx.where = _where(func.__code__, func.__code__.co_firstlineno)
    try:
        root = make_root_function(func, ctx)
        args = [ctx.wrap(a, ArgSource(i)) for i, a in enumerate(example_args)]
        if isinstance(fn, types.MethodType):
            # A bound method hook: its ``self`` is held by the method, so by identity here.
            label = f"self of {func.__module__}.{func.__qualname__}"
            args.insert(0, ctx.wrap(fn.__self__, ObjectSource(fn.__self__, label)))
        result = inline_call(ctx, root, args, {}, depth=0)
        torch_gm, plan, num_user = ctx.finish(result)
        plan.check()
        graph = _lower(ctx, torch_gm)
    except Refused as exc:
        if exc.where is None:
            exc.where = ctx.where
        refusal = exc.to_unsupported()
        log.debug("hook %s refused: %s", func.__qualname__, refusal)
        return refusal
    except _torch_compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as exc:  # a tracer bug must never become a wrong trace
        log.warning("hook tracer failed on %s", func.__qualname__, exc_info=True)
        return HookUnsupported(
            TraceRefusalKind.TRACER_ERROR,
            ctx.where,
            f"internal error of the hook tracer: {type(exc).__name__}: {exc}",
            "please report this hook; it runs eagerly meanwhile",
        )
    guards = tuple(ctx.guards)
    guard_fn = compile_guards(guards)
    guard_source = str(guard_fn.__globals__.get("__loom_source__", guard_fn.__doc__))
    input_sources = tuple(source for source, _, _ in ctx.inputs)
    input_numbers = tuple(ctx.input_numbers.get(node) for _, node, _ in ctx.inputs)
    process_constants = tuple(ctx.process_constants)
    fingerprint = compute_fingerprint(
        ctx.codes, guards, input_sources, graph, plan, num_user, input_numbers, process_constants
    )
    traced = TracedHook(
        fn=fn,
        graph=graph,
        input_sources=input_sources,
        input_numbers=input_numbers,
        num_user_outputs=num_user,
        replay=plan,
        guards=guards,
        guard_fn=guard_fn,
        guard_source=guard_source,
        fingerprint=fingerprint,
        opaque_calls=tuple(ctx.opaque_calls),
        process_constants=process_constants,
        stream_ops=tuple(ctx.stream_ops),
        torch_graph=torch_gm,
        _input_getters=tuple(source.compile() for source in input_sources),
        _globals=func.__globals__,
        _closure=func.__closure__ or (),
    )
    log.debug("traced hook %s\n%s", func.__qualname__, traced.describe())
    return traced


def unsupported_python(code: types.CodeType) -> HookUnsupported:
    """The refusal of every hook on a Python whose bytecode the tracer does not know:
    it names the version and the hook's first opcode without a handler here."""
    known = ", ".join(f"{major}.{minor}" for major, minor in KNOWN_PYTHONS)
    first = _first_unhandled(code)
    if first is None:
        where = _where(code, code.co_firstlineno)
        opcode = "every opcode of the hook has a handler, but their meaning here is unchecked"
    else:
        inst, inst_code = first
        line = inst.positions.lineno if inst.positions is not None else None
        where = _where(inst_code, line or inst_code.co_firstlineno)
        opcode = f"its first opcode unknown to the tracer is {inst.opname}"
    return HookUnsupported(
        TraceRefusalKind.UNSUPPORTED_PYTHON,
        where,
        f"the hook tracer does not know CPython {PY_VERSION}'s bytecode (it knows {known}); "
        f"{opcode}",
        f"the hook runs eagerly; trace it on CPython {known}",
    )


def _first_unhandled(code: types.CodeType) -> tuple[dis.Instruction, types.CodeType] | None:
    """The first instruction without a handler in ``code`` or the code it nests."""
    for inst in dis.get_instructions(code):
        if inst.opname not in HANDLERS:
            return inst, code
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and (found := _first_unhandled(const)) is not None:
            return found
    return None


def _where(code: types.CodeType, line: int) -> str:
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{line}"


def _fake_mode_for(example_args: Sequence[Any]) -> Any:
    stack = list(example_args)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            mode = _torch_compat.fake_mode_of_tensor(x)
            if mode is not None:
                return mode
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    return _torch_compat.new_fake_mode()


def _lower(ctx: TraceContext, torch_gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Aten-level, functional graph of the recorded torch-level graph."""
    torch_gm.graph.lint()  # type: ignore[no-untyped-call]
    with ctx.fake_mode:
        fakes = [fake.detach() for _, _, fake in ctx.inputs]
    functional = torch.func.functionalize(torch_gm, remove="mutations_and_views")
    with ctx.fake_mode, _torch_compat.python_dispatcher():
        gm = _torch_compat.make_fx(functional, tracing_mode="real")(*fakes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            target = node.args[0]
            if isinstance(target, torch.fx.Node) and target.op == "placeholder":
                ctx.where = _first_inplace_on_input(torch_gm) or ctx.where
                raise refuse(
                    TraceRefusalKind.INPUT_MUTATION,
                    "the hook mutates one of its input tensors in place",
                    "use the out-of-place op (e.g. t.mul(2) instead of t.mul_(2))",
                )
    gm.graph.eliminate_dead_code()
    gm.graph.lint()  # type: ignore[no-untyped-call]
    gm.recompile()
    for node in gm.graph.nodes:
        node.meta["loom_pass"] = "hook_tracer"
    return gm


def _first_inplace_on_input(torch_gm: torch.fx.GraphModule) -> str | None:
    """Where the first in-place op on an input (or a view of one) was recorded."""
    derived: set[torch.fx.Node] = set()
    for node in torch_gm.graph.nodes:
        if node.op == "placeholder":
            derived.add(node)
            continue
        first = node.args[0] if node.args else None
        if first not in derived:
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        inplace = (
            (name.endswith("_") and not name.startswith("__"))
            or (name.startswith("i") and name[1:] in _OPERATOR_NAMES)
            or name == "setitem"
        )
        if inplace:
            where = node.meta.get("loom_where")
            return str(where) if where is not None else None
        derived.add(node)
    return None


_OPERATOR_NAMES = frozenset(
    {
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
        "matmul",
    }
)
