"""Numbers read from pre-existing state, lifted to graph inputs where a torch op uses them.

A float (or int) that a hook reads from its closure, its globals or an object
(``unpack = lambda t: t * scale``) and passes to a torch op becomes a 0-d tensor
input of the graph, read from its source at each call, instead of a constant
baked into the graph and guarded by value: a per-step scale then needs no new
trace. Lifting is decided per use: the op is run on fake tensors once with the
number and once with a 0-d tensor in its place, and the number is lifted only
when both give the same metadata (dtype, shape, device). A number that decides
a shape, a branch or a Python value (``t.reshape(n)``, ``if scale > 1``,
``max(scale, 1)``) is specialized and guarded as before. Invariant: a lifted
input's graph computes what the constant would have computed, for every value
of the same type (the leaf's type is guarded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.fx

from loom_sidefx import COMPUTE_OPS, ArgSource, Computed, Original, Source
from loom_sidefx import Value as Recorded

from ._values import LazyNum, SymV, TensorV, Value

#: What an op on fake tensors raises when it refuses its arguments (fake-tensor and
#: data-dependence errors are RuntimeErrors; bad argument types and ranks the rest).
#: Anything else propagates (the op runs under the trace's fake mode, outside Dynamo's
#: tracing: none of Dynamo's control-flow signals can come from it).
FAKE_OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError)

__all__ = ["LiftContext", "NumberInput", "lift_numbers"]


#: How a lifted number becomes a graph input: a 0-d tensor of this dtype on this device.
NumberInput = tuple[torch.dtype, torch.device]


class LiftContext(Protocol):
    """What lifting needs from the trace (``TraceContext``)."""

    fake_mode: Any
    graph: torch.fx.Graph

    def number_input(self, source: Source, value: int | float, device: torch.device) -> TensorV:
        """The graph input (one per source, dtype and device) for a number at ``source``."""
        ...

    def lower_arg(self, v: Value) -> tuple[Any, Any]: ...


def _dtype_of(value: int | float) -> torch.dtype:
    return torch.float64 if isinstance(value, float) else torch.int64


def _leaf_ok(ref: Recorded) -> bool:
    """Whether every leaf of ``ref`` is a number read from state other than the hook's
    arguments (numbers inside a packed value are the pack's constants)."""
    if isinstance(ref, Original):
        return (
            ref.source is not None
            and not isinstance(ref.source.root(), ArgSource)
            and type(ref.obj) in (int, float)
        )
    if isinstance(ref, Computed):
        return ref.op in ("+", "-", "*", "/", "**") and _leaf_ok(ref.lhs) and _leaf_ok(ref.rhs)
    return type(ref) in (int, float)


def liftable(v: Value) -> bool:
    """Whether ``v`` is a number from pre-existing state that may become a graph input."""
    return isinstance(v, LazyNum) and type(v.value) in (int, float) and _leaf_ok(v.ref)


def _peek(ctx: LiftContext, v: Value) -> Any:
    """The fake value of an argument, without specializing (guarding) a lazy number."""
    if isinstance(v, TensorV):
        return v.fake
    if isinstance(v, SymV):
        return v.value
    if isinstance(v, LazyNum):
        return v.value
    return ctx.lower_arg(v)[0]


def _meta(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return (out.dtype, tuple(out.shape), out.device)
    if isinstance(out, (tuple, list)):
        return tuple(_meta(x) for x in out)
    return type(out)


def lift_numbers(
    ctx: LiftContext,
    run_fake: Callable[[Sequence[Any], Mapping[str, Any]], Any],
    args: list[Value],
    kwargs: dict[str, Value],
) -> tuple[list[Value], dict[str, Value]]:
    """``args`` and ``kwargs`` with every liftable number replaced by a graph input,
    where the op (``run_fake(fake_args, fake_kwargs)``) gives the same metadata."""
    keys: list[int | str] = [i for i, a in enumerate(args) if liftable(a)]
    keys += [k for k, a in kwargs.items() if liftable(a)]
    tensors = [a.fake for a in (*args, *kwargs.values()) if isinstance(a, TensorV)]
    if not keys or not tensors:
        return args, kwargs
    device = tensors[0].device
    numbers = {k: args[k] if isinstance(k, int) else kwargs[k] for k in keys}
    try:
        fake_args = [_peek(ctx, a) for a in args]
        fake_kwargs = {k: _peek(ctx, a) for k, a in kwargs.items()}
        want = run_fake(fake_args, fake_kwargs)
    except FAKE_OP_ERRORS:  # the op fails: the real call refuses it
        return args, kwargs
    # NOTE: a Python number never promotes a tensor; a 0-d tensor does when every
    # other operand is 0-d too (``1.0 / amax``): then try the result's own dtype.
    dtypes = {k: _dtype_of(n.value) for k, n in numbers.items()}  # type: ignore[attr-defined]
    if not _same_with(ctx, run_fake, fake_args, fake_kwargs, dtypes, device, want):
        fallback = getattr(_first_tensor(want), "dtype", None)
        dtypes = {k: _same_kind(d, fallback) for k, d in dtypes.items()}
        if not _same_with(ctx, run_fake, fake_args, fake_kwargs, dtypes, device, want):
            return args, kwargs  # the op needs the number as a Python value: specialize
    new_args, new_kwargs = list(args), dict(kwargs)
    for key, number in numbers.items():
        assert isinstance(number, LazyNum)
        lifted = _materialize(ctx, number.ref, _dtype_of(number.value), device)
        if lifted.fake.dtype != dtypes[key]:
            lifted = _call(ctx, "to", (lifted, dtypes[key]))
        if isinstance(key, int):
            new_args[key] = lifted
        else:
            new_kwargs[key] = lifted
    return new_args, new_kwargs


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for x in out if (t := _first_tensor(x)) is not None), None)
    return None


def _same_kind(dtype: torch.dtype, other: torch.dtype | None) -> torch.dtype:
    """``other`` if it is of ``dtype``'s kind (floating or integral), else ``dtype``."""
    if other is not None and other.is_floating_point == dtype.is_floating_point:
        if not other.is_complex and other != torch.bool:
            return other
    return dtype


def _same_with(
    ctx: LiftContext,
    run_fake: Callable[[Sequence[Any], Mapping[str, Any]], Any],
    fake_args: list[Any],
    fake_kwargs: dict[str, Any],
    dtypes: Mapping[int | str, torch.dtype],
    device: torch.device,
    want: Any,
) -> bool:
    """Whether the op gives ``want``'s metadata with 0-d tensors of ``dtypes`` in place
    of the numbers."""
    trial_args, trial_kwargs = list(fake_args), dict(fake_kwargs)
    try:
        with ctx.fake_mode:
            for key, dtype in dtypes.items():
                zero_d = torch.empty((), dtype=dtype, device=device)
                if isinstance(key, int):
                    trial_args[key] = zero_d
                else:
                    trial_kwargs[key] = zero_d
        got = run_fake(trial_args, trial_kwargs)
    except FAKE_OP_ERRORS:  # a 0-d tensor is refused where the number is taken
        return False
    return bool(_meta(got) == _meta(want))


def _materialize(
    ctx: LiftContext, ref: Recorded, dtype: torch.dtype, device: torch.device
) -> TensorV:
    """The graph value of a lifted number: inputs for its leaves, ops for its arithmetic,
    computed in ``dtype`` (float64 when the number is a float, as Python computes it)."""
    if isinstance(ref, Original):
        assert ref.source is not None
        leaf = ctx.number_input(ref.source, ref.obj, device)
        return leaf if leaf.fake.dtype == dtype else _call(ctx, "to", (leaf, dtype))
    if isinstance(ref, Computed):
        lhs = _operand(ctx, ref.lhs, dtype, device)
        rhs = _operand(ctx, ref.rhs, dtype, device)
        return _call(ctx, COMPUTE_OPS[ref.op], (lhs, rhs))
    raise AssertionError(f"not a liftable number: {ref!r}")


def _operand(ctx: LiftContext, ref: Recorded, dtype: torch.dtype, device: torch.device) -> Any:
    if isinstance(ref, (Original, Computed)):
        return _materialize(ctx, ref, dtype, device)
    return ref


def _call(ctx: LiftContext, target: Any, args: tuple[Any, ...]) -> TensorV:
    """One op on lifted values (``"to"``: the method), recorded in the graph."""
    fakes = tuple(a.fake if isinstance(a, TensorV) else a for a in args)
    nodes = tuple(a.node if isinstance(a, TensorV) else a for a in args)
    with ctx.fake_mode:
        if target == "to":
            out = fakes[0].to(fakes[1])
            node = ctx.graph.call_method("to", nodes)
        else:
            out = target(*fakes)
            node = ctx.graph.call_function(target, nodes)
    node.meta["val"] = out
    return TensorV(node, out)
