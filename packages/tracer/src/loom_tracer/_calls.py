"""Calls: user functions (inlined), torch functions and Tensor methods (recorded), builtins
from an allowlist (evaluated symbolically), container methods, opaque ``torch.fx.wrap``
functions; everything else is refused with the callable's name.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from . import _torch_compat
from ._builtins import BUILTINS, Builtin, builtin, no_kwargs
from ._constants import python_op, python_value
from ._containers import call_dict_method, call_list_method, call_set_method, iterate, set_item
from ._context import TraceContext, operand
from ._frame import inline_call
from ._kinds import is_const, is_symbolic
from ._operators import binary_op, get_item, truthy
from ._process_constants import describe_call, process_constant_name
from ._refusal import TraceRefusalKind, refuse
from ._streams import call_ordering_function, call_ordering_method, record_stream
from ._values import (
    ConstV,
    DictV,
    FunctionV,
    GradEnterV,
    GradExitV,
    GradModeV,
    IteratorV,
    LazyNum,
    ListV,
    MethodV,
    NoOpCallV,
    OrderingV,
    SetV,
    SymV,
    TensorV,
    TupleV,
    Value,
)

# torch namespaces whose callables are never traced (side effects outside tensors).
_TORCH_DENIED_MODULES = (
    "torch.cuda",
    "torch.distributed",
    "torch.autograd",
    "torch.compiler",
    "torch.utils",
    "torch.fx",
    "torch._dynamo",
    "torch.jit",
    "torch.serialization",
    "torch.random",
    "torch.backends",
    "torch.hub",
    "torch.onnx",
    "torch.profiler",
)
_TORCH_DENIED_NAMES = frozenset(
    {
        "compile",
        "save",
        "load",
        "manual_seed",
        "seed",
        "set_grad_enabled",
        "set_default_dtype",
        "set_default_device",
        "use_deterministic_algorithms",
        "set_printoptions",
        "inference_mode",
        "set_num_threads",
        "no_grad",
        "enable_grad",
    }
)


def call_value(
    ctx: TraceContext, fn: Value, args: list[Value], kwargs: dict[str, Value], depth: int
) -> Value:
    """Trace ``fn(*args, **kwargs)``."""
    if isinstance(fn, FunctionV):
        if fn.fn is not None and _torch_compat.is_fx_wrapped(fn.fn):
            return ctx.call_torch(fn.fn, args, kwargs, opaque=True)
        return inline_call(ctx, fn, args, kwargs, depth)
    if isinstance(fn, MethodV):
        return call_method(ctx, fn, args, kwargs, depth)
    if isinstance(fn, GradExitV):
        ctx.grad_enabled = fn.previous
        return ConstV(None)
    if isinstance(fn, GradEnterV):
        ctx.grad_enabled = fn.enabled
        return ConstV(None)
    if isinstance(fn, NoOpCallV):
        return fn.result
    if isinstance(fn, ConstV):
        return call_const(ctx, fn.value, args, kwargs, depth)
    raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"calling a {fn.py_type.__qualname__}")


def call_method(
    ctx: TraceContext, m: MethodV, args: list[Value], kwargs: dict[str, Value], depth: int
) -> Value:
    self_v, name, func = m.self_v, m.name, m.func
    if isinstance(self_v, OrderingV):
        return call_ordering_method(ctx, self_v, name, args, kwargs)
    if isinstance(func, types.FunctionType):
        return call_value(ctx, ctx.function_value(func, None), [self_v, *args], kwargs, depth)
    if isinstance(self_v, TensorV):
        if name == "__getitem__":
            return get_item(ctx, self_v, args[0])
        if name == "record_stream":
            return record_stream(ctx, self_v, args, kwargs)
        return ctx.call_torch(None, [self_v, *args], kwargs, method=name)
    if kwargs and not isinstance(self_v, ConstV):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL,
            f"{self_v.py_type.__qualname__}.{name} with keyword arguments",
        )
    if isinstance(self_v, ListV) and func in (getattr(list, name, None), None):
        return call_list_method(ctx, self_v, name, args)
    if isinstance(self_v, DictV) and func in (getattr(dict, name, None), None):
        return call_dict_method(ctx, self_v, name, args)
    if isinstance(self_v, SetV) and func in (getattr(set, name, None), None):
        return call_set_method(ctx, self_v, name, args)
    if isinstance(self_v, TupleV) and name in ("count", "index"):
        return ConstV(
            python_op(
                getattr(python_value(ctx, self_v), name), *[python_value(ctx, a) for a in args]
            )
        )
    if isinstance(self_v, (ConstV, LazyNum)):
        value = operand(ctx, self_v)
        if isinstance(value, type) and isinstance(func, types.FunctionType):
            return call_value(ctx, ctx.function_value(func, None), [self_v, *args], kwargs, depth)
        if not is_const(value) and not isinstance(value, (torch.finfo, torch.iinfo)):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_CALL, f"method {name} of a {type(value).__qualname__}"
            )
        result = python_op(
            getattr(value, name),
            *[python_value(ctx, a) for a in args],
            **{k: python_value(ctx, v) for k, v in kwargs.items()},
        )
        if not (is_const(result) or is_symbolic(result)):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_CALL,
                f"{type(value).__qualname__}.{name} returned a {type(result).__qualname__}",
            )
        return ConstV(result)
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_CALL, f"method {name} of a {self_v.py_type.__qualname__}"
    )


def _is_torch_callable(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return getattr(fn, "__objclass__", None) is torch.Tensor
    if not (module == "torch" or module.startswith("torch.")):
        return False
    if (
        module.startswith(_TORCH_DENIED_MODULES)
        or getattr(fn, "__name__", "") in _TORCH_DENIED_NAMES
    ):
        return False
    return callable(fn) and not isinstance(fn, type)


def call_const(
    ctx: TraceContext, fn: Any, args: list[Value], kwargs: dict[str, Value], depth: int
) -> Value:
    impl = BUILTINS.get(fn) if _hashable(fn) else None
    if impl is not None:
        return impl(ctx, args, kwargs, depth)
    if fn is torch.no_grad or fn is torch.enable_grad:
        if args or kwargs:
            raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"{fn.__name__} with arguments")
        return GradModeV(fn is torch.enable_grad)
    if fn is torch.is_grad_enabled:
        return ConstV(ctx.grad_enabled)
    folded = process_constant_name(fn)
    if folded is not None:
        return _fold_process_constant(ctx, fn, folded, args, kwargs)
    ordering = call_ordering_function(ctx, fn, args, kwargs)
    if ordering is not None:
        return ordering
    if fn in (torch.finfo, torch.iinfo):
        return ConstV(fn(*[ctx.specialize(a) for a in args]))
    if isinstance(fn, type) and issubclass(fn, BaseException):
        return ConstV(python_op(fn, *[python_value(ctx, a) for a in args]))
    if _torch_compat.is_fx_wrapped(fn):
        return ctx.call_torch(fn, args, kwargs, opaque=True)
    if _is_torch_callable(fn):
        return ctx.call_torch(fn, args, kwargs)
    module = getattr(fn, "__module__", None)
    if module in ("_operator", "operator") and _mutates_in_place(fn):
        if not (args and isinstance(args[0], TensorV)):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_CALL, f"operator.{fn.__name__} on a Python object"
            )
    if module in ("math", "_operator", "operator") and callable(fn):
        if any(isinstance(a, TensorV) for a in args):
            if module == "math":
                raise refuse(
                    TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW, f"math.{fn.__name__} on a tensor"
                )
            return ctx.call_torch(fn, args, kwargs)
        return ConstV(python_op(fn, *[python_value(ctx, a) for a in args]))
    if isinstance(fn, types.FunctionType):
        return call_value(ctx, ctx.function_value(fn, None), args, kwargs, depth)
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    if fn is print:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
            "print() inside a hook",
            "append to a list and print it outside the compiled region",
        )
    if isinstance(fn, type):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL,
            f"creating an instance of {name} inside a hook",
            "create objects outside the hook and mutate them inside",
        )
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_CALL,
        f"calling {getattr(fn, '__module__', '?')}.{name} is not supported",
    )


def _fold_process_constant(
    ctx: TraceContext, fn: Any, name: str, args: list[Value], kwargs: dict[str, Value]
) -> Value:
    """``torch.cuda.is_available()`` and its kind: evaluated now, recorded, not traced into."""
    no_kwargs(name, kwargs)
    values = tuple(python_value(ctx, a) for a in args)
    result = python_op(fn, *values)
    if not is_const(result):  # immutable data only: a bool, an int, a tuple of them
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL, f"{name} returned a {type(result).__qualname__}"
        )
    ctx.record_process_constant(describe_call(name, values, result))
    return ConstV(result)


def _mutates_in_place(fn: Any) -> bool:
    name = getattr(fn, "__name__", "")
    return name in ("setitem", "delitem") or (
        name.startswith("i")
        and name
        not in ("index", "indexOf", "is_", "is_not", "invert", "inv", "is_none", "is_not_none")
    )


def _hashable(fn: Any) -> bool:
    try:
        hash(fn)
    except TypeError:
        return False
    return True


# ------------------------------------------------------------------ builtins


@builtin(len)
def _len(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("len", kwargs)
    (x,) = args
    ctx.require_base_protocol(x, "__len__")
    if isinstance(x, TensorV):
        if x.fake.dim() == 0:
            raise refuse(TraceRefusalKind.HOOK_RAISES, "TypeError: len() of a 0-d tensor")
        return ctx.call_torch(None, [x, ConstV(0)], {}, method="size")  # len() would specialize
    if isinstance(x, DictV):
        return ConstV(len(ctx.dict_items(x)))
    if isinstance(x, SetV):
        return ConstV(len(ctx.set_items(x)))
    if isinstance(x, (ListV, TupleV)):
        return ConstV(len(ctx.sequence_items(x)))
    return ConstV(python_op(len, ctx.specialize(x)))


@builtin(isinstance)
def _isinstance(
    ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int
) -> Value:
    no_kwargs("isinstance", kwargs)
    x, cls_v = args
    cls = ctx.specialize(cls_v)
    classes = cls if isinstance(cls, tuple) else (cls,)
    if isinstance(x, TensorV) and any(
        isinstance(c, type) and issubclass(c, torch.Tensor) and c is not torch.Tensor
        for c in classes
    ):
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "isinstance() against a Tensor subclass")
    return ConstV(python_op(issubclass, ctx.type_of(x), cls))


@builtin(type)
def _type(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    if len(args) != 1 or kwargs:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "type() with more than one argument")
    return ConstV(ctx.type_of(args[0]))


def _items_of(ctx: TraceContext, args: list[Value]) -> list[Value]:
    return ctx.sequence_items(args[0]) if len(args) == 1 else list(args)


def _make_min_max(fn: Callable[..., Any]) -> Builtin:
    def impl(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
        no_kwargs(fn.__name__, kwargs)
        items = _items_of(ctx, args)
        if any(isinstance(x, TensorV) for x in items):
            raise refuse(
                TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW,
                f"{fn.__name__}() compares tensors by value",
                "use torch.maximum / torch.minimum",
            )
        values = [python_value(ctx, x) for x in items]
        return ConstV(python_op(fn, values))

    return impl


BUILTINS[min] = _make_min_max(min)
BUILTINS[max] = _make_min_max(max)


@builtin(range)
def _range(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("range", kwargs)
    return ConstV(python_op(range, *[ctx.specialize(a) for a in args]))


@builtin(enumerate)
def _enumerate(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    start = ctx.specialize(kwargs.pop("start", args[1] if len(args) > 1 else ConstV(0)))
    no_kwargs("enumerate", kwargs)
    items = ctx.sequence_items(args[0])
    return IteratorV([TupleV((ConstV(start + i), x)) for i, x in enumerate(items)])


@builtin(zip)
def _zip(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    strict = bool(ctx.specialize(kwargs.pop("strict", ConstV(False))))
    no_kwargs("zip", kwargs)
    seqs = [ctx.sequence_items(a) for a in args]
    if strict and len({len(s) for s in seqs}) > 1:
        raise refuse(
            TraceRefusalKind.HOOK_RAISES, "ValueError: zip() arguments have different lengths"
        )
    return IteratorV([TupleV(tuple(group)) for group in zip(*seqs, strict=False)])


@builtin(reversed)
def _reversed(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("reversed", kwargs)
    return IteratorV(list(reversed(ctx.sequence_items(args[0]))))


@builtin(iter)
def _iter(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("iter", kwargs)
    return iterate(ctx, args[0])


@builtin(next)
def _next(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("next", kwargs)
    it = args[0]
    if not isinstance(it, IteratorV):
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, f"next() on a {it.py_type.__qualname__}")
    if it.pos >= len(it.items):
        if len(args) == 2:
            return args[1]
        raise refuse(TraceRefusalKind.HOOK_RAISES, "StopIteration")
    it.pos += 1
    return it.items[it.pos - 1]


@builtin(sorted)
def _sorted(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    reverse = bool(ctx.specialize(kwargs.pop("reverse", ConstV(False))))
    no_kwargs("sorted", kwargs)
    values = [python_value(ctx, x) for x in ctx.sequence_items(args[0])]
    return ctx.new_list(ConstV(v) for v in python_op(sorted, values, reverse=reverse))


def _make_container(kind: type) -> Builtin:
    def impl(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
        no_kwargs(kind.__name__, kwargs)
        items = ctx.sequence_items(args[0]) if args else []
        if kind is list:
            return ctx.new_list(items)
        if kind is tuple:
            return TupleV(tuple(items))
        return ctx.new_set(ctx.specialize(x) for x in items)

    return impl


for _kind in (list, tuple, set):
    BUILTINS[_kind] = _make_container(_kind)


@builtin(dict)
def _dict(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    out = ctx.new_dict()
    if args:
        call_dict_method(ctx, out, "update", [args[0]])
    for key, value in kwargs.items():
        set_item(ctx, out, key, value)
    return out


def _make_scalar(fn: Callable[..., Any]) -> Builtin:
    def impl(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
        no_kwargs(getattr(fn, "__name__", "?"), kwargs)
        if fn is abs and len(args) == 1 and isinstance(args[0], TensorV):
            return ctx.call_torch(operator.abs, args, {})
        if fn is bool and len(args) == 1:
            return ConstV(truthy(ctx, args[0]))
        if fn is callable:
            if isinstance(args[0], SymV):
                return ConstV(False)
            return ConstV(
                not isinstance(args[0], (ConstV, LazyNum)) or callable(ctx.specialize(args[0]))
            )
        return ConstV(python_op(fn, *[python_value(ctx, a) for a in args]))

    return impl


for _scalar_fn in (
    int,
    float,
    bool,
    str,
    abs,
    round,
    divmod,
    pow,
    repr,
    format,
    callable,
    chr,
    ord,
):
    BUILTINS[_scalar_fn] = _make_scalar(_scalar_fn)


@builtin(sum)
def _sum(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("sum", kwargs)
    total: Value = args[1] if len(args) > 1 else ConstV(0)
    for x in ctx.sequence_items(args[0]):
        total = binary_op(ctx, "+", total, x)
    return total


BUILTINS[any] = lambda ctx, args, kwargs, depth: ConstV(
    any(truthy(ctx, x) for x in ctx.sequence_items(args[0]))
)
BUILTINS[all] = lambda ctx, args, kwargs, depth: ConstV(
    all(truthy(ctx, x) for x in ctx.sequence_items(args[0]))
)


@builtin(map)
def _map(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("map", kwargs)
    seqs = [ctx.sequence_items(a) for a in args[1:]]
    return IteratorV(
        [call_value(ctx, args[0], list(group), {}, depth) for group in zip(*seqs, strict=False)]
    )


@builtin(filter)
def _filter(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("filter", kwargs)
    pred = args[0]
    items = ctx.sequence_items(args[1])
    if isinstance(pred, ConstV) and pred.value is None:
        return IteratorV([x for x in items if truthy(ctx, x)])
    return IteratorV([x for x in items if truthy(ctx, call_value(ctx, pred, [x], {}, depth))])


def _make_refused(fn: Callable[..., Any]) -> Builtin:
    def impl(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
        kind = (
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT
            if fn in (print, input, open)
            else TraceRefusalKind.UNSUPPORTED_CALL
        )
        raise refuse(
            kind,
            f"builtin {fn.__name__}() cannot be traced into a cached graph",
            "print/log outside the hook; id() and hash() differ between processes",
        )

    return impl


for _refused_fn in (
    id,
    hash,
    print,
    input,
    open,
    exec,
    eval,
    globals,
    locals,
    vars,
):
    BUILTINS[_refused_fn] = _make_refused(_refused_fn)
