"""The only door from ``loom_hops`` to private torch APIs.

Everything here is pinned to torch 2.11 and written so that the next version is
a small diff: each name is imported once, under one spelling, and re-exported
with a type that the rest of the package relies on. A test greps the package
for ``torch._`` outside this module.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._dynamo.exc import RestartAnalysis, ShortenTraceback, SkipFrame
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch._prims.rng_prims import run_and_save_rng_state
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)
from torch.fx.experimental.symbolic_shapes import free_symbols, is_symbolic, statically_known_true
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "CONTROL_FLOW_EXCEPTIONS",
    "REGISTER_HOOK_HOP",
    "DispatchKey",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "ProxyTorchDispatchMode",
    "autograd_function_apply_op",
    "below_autograd",
    "detect_fake_mode",
    "disable_proxy_modes_tracing",
    "fake_mode_of",
    "free_symbols",
    "in_checkpointed_region",
    "in_compiled_autograd",
    "install_dynamo_guard",
    "is_rng_state_output",
    "is_sdpa_philox_output",
    "is_sym_node",
    "is_symbolic",
    "is_torch_op",
    "is_view_op",
    "make_fx",
    "native_hook_inlining_disabled",
    "python_dispatcher",
    "pytree",
    "reenter_make_fx",
    "saved_tensors_hooks_disabled",
    "saved_tensors_hooks_tracing_disabled",
    "statically_known_true",
    "top_saved_tensors_hooks",
    "track_tensor_tree",
]

#: ``(pack, unpack)`` as torch stores it, or ``None`` when no hooks are active.
RawHooks = tuple[Callable[..., Any], Callable[..., Any]] | None


#: What Dynamo raises to steer a compilation (restart the analysis, skip the frame):
#: never a refusal of a hook; it must reach Dynamo.
CONTROL_FLOW_EXCEPTIONS: tuple[type[BaseException], ...] = (
    RestartAnalysis,
    SkipFrame,
    ShortenTraceback,
)


def top_saved_tensors_hooks() -> RawHooks:
    """The innermost active ``saved_tensors_hooks`` pair, read even while tracing."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not hooks:
        return None
    pack, unpack = hooks
    return (pack, unpack)


@contextlib.contextmanager
def saved_tensors_hooks_disabled(message: str) -> Iterator[None]:
    """Stop autograd from applying the active saved-tensor hooks inside the block.

    The same mechanism AOTAutograd uses for GraphModule hooks it inlined
    (``runtime_wrappers._disable_saved_tensors_hooks``): tensors saved inside the
    block are saved as they are; pushing new hooks inside raises ``message``.
    """
    ag = torch._C._autograd
    previous = ag._saved_tensors_hooks_get_disabled_error_message()
    ag._saved_tensors_hooks_disable(message, False)
    try:
        yield
    finally:
        if previous is None:
            ag._saved_tensors_hooks_enable()
        else:
            ag._saved_tensors_hooks_disable(previous, False)


@contextlib.contextmanager
def saved_tensors_hooks_tracing_disabled() -> Iterator[None]:
    """Autograd does not run saved-tensor hooks while we trace (Dynamo's own switch)."""
    prior = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_set_tracing(prior)


def below_autograd() -> contextlib.AbstractContextManager[Any]:
    """Dispatch below the Autograd key (what a HOP's autograd rule redispatches to)."""
    return torch._C._AutoDispatchBelowAutograd()


def reenter_make_fx(fn: Callable[..., Any]) -> Callable[..., torch.fx.GraphModule]:
    """Trace ``fn`` as a subgraph of the make_fx session that is running now."""
    from torch._higher_order_ops.utils import reenter_make_fx as _reenter

    return _reenter(fn)  # type: ignore[no-any-return, no-untyped-call]


def is_sym_node(node: Any) -> bool:
    """Whether an FX node carries a symbolic int/float/bool value."""
    if not isinstance(node, torch.fx.Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def fake_mode_of(values: Sequence[Any]) -> FakeTensorMode | None:
    """The fake mode that owns ``values`` (or the ambient one)."""
    mode = detect_fake_mode(list(values))
    return mode if isinstance(mode, FakeTensorMode) else None


def python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher that symbolic-shape tracing needs (as AOTAutograd enables it)."""
    return torch._C._EnablePythonDispatcher()  # type: ignore[no-any-return]


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing or running a backward right now."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.in_compiled_autograd_region)


def install_dynamo_guard(check: Callable[[], bool], description: str) -> bool:
    """Add a global guard to the Dynamo frame being compiled right now.

    Called from inside a backend: Dynamo builds the frame's guards after the
    backend returns, so ``check()`` becomes part of the cache entry and a call
    where it is false recompiles (bounded by Dynamo's recompile limit, after
    which the frame runs eagerly). Returns ``False`` outside a Dynamo compile.
    """
    return _install_lambda_guard(lambda _: check(), description)


def install_no_hooks_guard(description: str) -> bool:
    """:func:`install_dynamo_guard` for "no saved-tensor hooks are active", the check
    every call of a frame compiled without hooks makes: one C call, no Python helper."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    return _install_lambda_guard(lambda _: not top(True), description)


def _install_lambda_guard(fn: Callable[[Any], bool], description: str) -> bool:
    from torch._dynamo.guards import get_verbose_code_parts
    from torch._dynamo.source import GlobalStateSource
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    if tc is None:
        return False

    def create(builder: Any, guard: Any) -> None:
        parts = get_verbose_code_parts([description], guard)
        builder.guard_manager.root.add_lambda_guard(fn, parts, guard.user_stack)

    create.__name__ = "LOOM_SAVED_TENSORS_HOOKS"
    tc.guards_context.dynamo_guards.add(GlobalStateSource().make_guard(create))
    return True


def is_torch_op(target: Any) -> bool:
    """Whether an FX ``call_function`` target is a torch operator overload (or packet)."""
    return isinstance(target, (OpOverload, OpOverloadPacket, HigherOrderOperator))


@contextlib.contextmanager
def native_hook_inlining_disabled(active: RawHooks) -> Iterator[None]:
    """Keep AOTAutograd from inlining ``GraphModule`` hooks itself while we compile.

    AOTAutograd 2.11 inlines the innermost pair when both are GraphModules
    (``maybe_inline_graph_saved_tensors_hooks``) and then disables them at
    runtime. loom places them itself, so it pushes an identity pair of Python
    functions on top for the duration of the compile: AOTAutograd sees hooks it
    does not inline and leaves the runtime alone. Hooks never run while AOT
    traces (it sets the tracing flag), so the pair is never called.
    """
    if active is None or not all(isinstance(h, torch.fx.GraphModule) for h in active):
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        yield


def _identity(x: Any) -> Any:
    return x


def _has_register_hook_hop() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch._higher_order_ops.register_hook") is not None


#: Whether Dynamo records ``y.register_hook(h)`` on an intermediate as its own
#: ``register_hook`` HOP (torch 2.13 and later), which runs several hooks on one
#: tensor in registration order by itself; 2.11 and 2.12 emit an identity
#: ``autograd_function_apply`` chain that ``order_intermediate_hooks`` reorders.
REGISTER_HOOK_HOP: bool = _has_register_hook_hop()


def autograd_function_apply_op() -> Any:
    """The HOP Dynamo 2.11 emits for ``register_hook`` on an intermediate (and for
    ``autograd.Function``s it traces); ``None`` when this torch has none."""
    return getattr(torch.ops.higher_order, "autograd_function_apply", None)


def is_view_op(target: Any) -> bool:
    """Whether an aten overload returns a view of an input (``t``, ``permute``, ``view``...)."""
    if not isinstance(target, OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def is_rng_state_output(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the RNG state a recomputed random op saves for its backward.

    The partitioner (``functionalize_rng_ops``, activation checkpointing of an op
    tagged ``nondeterministic_seeded`` such as CPU SDPA) wraps the forward op in
    ``run_and_save_rng_state`` and saves item 0, the generator state, which the
    backward receives under another name (``rng_state_output_N``).
    """
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args[0], node.args[1]
    return (
        isinstance(index, int)
        and index == 0
        and isinstance(source, torch.fx.Node)
        and source.op == "call_function"
        and source.target is run_and_save_rng_state
    )


@functools.cache
def _sdpa_philox_outputs() -> dict[Any, frozenset[int]]:
    """Attention ops whose outputs include the dropout RNG's seed and offset, by index."""
    aten = torch.ops.aten
    table: dict[str, frozenset[int]] = {
        "_scaled_dot_product_flash_attention": frozenset({6, 7}),
        "_scaled_dot_product_cudnn_attention": frozenset({6, 7}),
        "_scaled_dot_product_efficient_attention": frozenset({2, 3}),
        "_flash_attention_forward": frozenset({2, 3}),
        "_efficient_attention_forward": frozenset({2, 3}),
    }
    return {getattr(aten, name).default: idx for name, idx in table.items() if hasattr(aten, name)}


def is_sdpa_philox_output(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the philox seed or offset an attention op returns for its backward.

    Their device is decided when the op runs, and differs by op and build: memory-
    efficient attention returns CPU scalars without dropout or outside a CUDA-graph
    capture, flash attention (torch 2.11) a uint64 CUDA tensor. PyTorch's meta
    functions return them on ``meta`` ("Note [Seed and Offset]" in
    ``_meta_registrations.py``) and fake tensors then put them on the query's device,
    so a graph op fed one is compiled for a device the tensor may not be on (Inductor
    passes the CPU scalar to a Triton kernel as a pointer: "CUDA driver error:
    invalid argument").
    """
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args[0], node.args[1]
    if not isinstance(source, torch.fx.Node) or source.op != "call_function":
        return False
    return index in _sdpa_philox_outputs().get(source.target, ())


def in_checkpointed_region(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an op of a checkpointed region (``torch.utils.checkpoint``):
    AOTAutograd tags each with its policy (``meta["recompute"]``), whether the
    partitioner then recomputes it or saves it."""
    return isinstance(node.meta.get("recompute"), CheckpointPolicy)
