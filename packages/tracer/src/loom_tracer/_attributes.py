"""Attribute access on symbolic values: reads, buffered writes and deletes.

Reads follow Python's lookup order closely enough to be exact for the objects
the tracer accepts: writes buffered during the trace win, then data
descriptors (properties are inlined, anything else is refused), then the
instance ``__dict__``, then the class. Writes are allowed on pre-existing
objects whose class keeps ``object.__setattr__`` and become ``SET_ATTR``
effects; everything else is refused.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from loom_sidefx import AttrSource, GuardKind, Missing, ObjectSource, Staged

from ._builtins import builtin, no_kwargs
from ._calls import call_value
from ._context import TraceContext, slot
from ._kinds import is_const, is_symbolic
from ._refusal import Refused, TraceRefusalKind, refuse
from ._streams import ordering_attr
from ._values import (
    ConstV,
    FunctionV,
    LazyNum,
    MethodV,
    ObjectV,
    OrderingV,
    SuperV,
    TensorV,
    TupleV,
    Value,
)

TENSOR_METADATA_ATTRS = frozenset(
    {
        "dtype",
        "shape",
        "device",
        "requires_grad",
        "is_leaf",
        "ndim",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "layout",
        "is_nested",
        "itemsize",
        "nbytes",
    }
)
TENSOR_VALUED_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Tensor methods that read data into Python, leave the graph, or mutate autograd state.
TENSOR_METHOD_DENYLIST = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "data_ptr",
        "backward",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "untyped_storage",
        "storage",
        "retain_grad",
        "requires_grad_",
        "equal",
        "allclose",
        "is_nonzero",
        "set_",
        "resize_",
        "resize_as_",
        "share_memory_",
        "detach_",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__setstate__",
        "__reduce_ex__",
        "__deepcopy__",
        "pin_memory",
        "apply_",
        "map_",
    }
)


def _static_lookup(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _is_data_descriptor(attr: object) -> bool:
    t = type(attr)
    return hasattr(t, "__set__") or hasattr(t, "__delete__")


def get_attr(ctx: TraceContext, v: Value, name: str, depth: int) -> Value:
    """``v.name`` for a symbolic value."""
    if isinstance(v, TensorV):
        return _tensor_attr(ctx, v, name)
    if isinstance(v, LazyNum):
        v = ConstV(ctx.specialize(v))
    if isinstance(v, ConstV):
        return _const_attr(ctx, v, name)
    if isinstance(v, ObjectV):
        return _object_attr(ctx, v, name, depth)
    if isinstance(v, SuperV):
        return _super_attr(ctx, v, name)
    if isinstance(v, OrderingV):
        return ordering_attr(v, name)
    if isinstance(v, TupleV):
        fields = v.fields or getattr(v.cls, "_fields", ())
        if name in fields:
            return v.items[fields.index(name)]
        if name in ("count", "index"):
            return MethodV(v, name, getattr(tuple, name))
    if isinstance(v, FunctionV) and name in ("__name__", "__qualname__", "__module__"):
        value = {
            "__name__": v.name,
            "__qualname__": v.name,
            "__module__": v.globals.get("__name__"),
        }[name]
        return ConstV(value)
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_ATTRIBUTE,
        f"attribute {name!r} of a {v.py_type.__qualname__} is not supported",
    )


def _tensor_attr(ctx: TraceContext, v: TensorV, name: str) -> Value:
    if name in TENSOR_METADATA_ATTRS:
        value = getattr(v.fake, name)
        if is_symbolic(value) or (name == "nbytes" and is_symbolic(tuple(v.fake.shape))):
            return ctx.call_torch(getattr, [v, ConstV(name)], {})
        return ConstV(value)
    if name in TENSOR_VALUED_ATTRS:
        return ctx.call_torch(getattr, [v, ConstV(name)], {})
    if name in TENSOR_METHOD_DENYLIST:
        raise refuse(
            TraceRefusalKind.DATA_DEPENDENT_OP
            if name in ("item", "tolist", "numpy", "equal", "allclose", "is_nonzero")
            else TraceRefusalKind.UNSUPPORTED_CALL,
            f"Tensor.{name} cannot be traced into a graph",
            "keep Python logic on tensor metadata; leave data-dependent or autograd work outside the hook",
        )
    attr = getattr(torch.Tensor, name, None)
    if attr is not None and callable(attr) and not name.startswith("_"):
        return MethodV(v, name, attr)
    if name in ("__getitem__", "__add__", "__mul__", "__sub__", "__truediv__", "__neg__"):
        return MethodV(v, name, attr)
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_ATTRIBUTE,
        f"tensor attribute {name!r} is not supported",
        "use dtype, shape, device, requires_grad or a Tensor method",
    )


def _const_attr(ctx: TraceContext, v: ConstV, name: str) -> Value:
    value = v.value
    try:
        attr = getattr(value, name)
    except AttributeError as exc:
        raise refuse(TraceRefusalKind.HOOK_RAISES, f"AttributeError: {exc}") from None
    if isinstance(value, types.ModuleType):
        constant_module = value.__name__.split(".")[0] in (
            "torch",
            "math",
            "operator",
            "builtins",
            "functools",
            "itertools",
        )
        source = (
            AttrSource(v.source, name) if v.source is not None and not constant_module else None
        )
        if source is None and isinstance(attr, torch.Tensor):
            raise refuse(
                TraceRefusalKind.UNSUPPORTED_VALUE, f"module tensor {value.__name__}.{name}"
            )
        if source is None and isinstance(attr, types.FunctionType):
            return ConstV(attr)
        return ctx.wrap(attr, source) if source is not None else _const_or_wrap(ctx, attr)
    if isinstance(value, type):
        source = AttrSource(v.source, name) if v.source is not None else None
        static = _static_lookup(value, name)
        if isinstance(static, classmethod):
            return MethodV(v, name, static.__func__)
        if isinstance(attr, types.FunctionType):
            return ConstV(attr) if source is None else ctx.wrap(attr, source)
        return ctx.wrap(attr, source) if source is not None else _const_or_wrap(ctx, attr)
    if callable(attr) and not isinstance(attr, type):
        return MethodV(v, name, getattr(type(value), name, None))
    if is_const(attr):
        return ConstV(attr)
    raise refuse(
        TraceRefusalKind.UNSUPPORTED_ATTRIBUTE, f"attribute {name!r} of {type(value).__qualname__}"
    )


def _const_or_wrap(ctx: TraceContext, attr: Any) -> Value:
    if is_const(attr) or callable(attr) or isinstance(attr, types.ModuleType):
        return ConstV(attr)
    return ctx.wrap(attr, None)


def _object_attr(ctx: TraceContext, v: ObjectV, name: str, depth: int) -> Value:
    with ctx.log() as se:
        stored = se.load_attr(v.ref, name)
    if isinstance(stored, Staged):
        written: Value = stored.payload
        return written
    if stored is Missing.ABSENT and not v.ref.is_new:
        raise refuse(TraceRefusalKind.HOOK_RAISES, f"AttributeError: {name!r} was deleted")
    cls = v.py_type
    static = _static_lookup(cls, name)
    if static is not None and _is_data_descriptor(static):
        if isinstance(static, property) and isinstance(static.fget, types.FunctionType):
            getter = ctx.function_value(static.fget, None)
            return call_value(ctx, getter, [v], {}, depth)
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_ATTRIBUTE,
            f"attribute {name!r} of {cls.__qualname__} is a {type(static).__name__}",
        )
    inst_dict = getattr(v.obj, "__dict__", None) if v.obj is not None else None
    if inst_dict is not None and name in inst_dict:
        return ctx.wrap(
            inst_dict[name], AttrSource(v.source, name) if v.source is not None else None
        )
    if static is not None:
        if inst_dict is not None:
            # An instance attribute of that name, set later, would shadow the class's.
            ctx.guard_attr_absent(v.source, name)
        if isinstance(static, types.FunctionType):
            if v.source is not None and getattr(cls, name, None) is static:
                # The class dict is mutable too: the method must stay this function.
                class_source = ObjectSource(cls, f"class {cls.__module__}.{cls.__qualname__}")
                ctx.guard(AttrSource(class_source, name), GuardKind.IDENTITY, static)
            return MethodV(v, name, static)
        if isinstance(static, staticmethod):
            return ConstV(static.__func__)
        if isinstance(static, classmethod):
            return MethodV(ConstV(cls), name, static.__func__)
        if callable(static):
            return MethodV(v, name, static)
        if v.source is not None:
            return ctx.wrap(getattr(v.obj, name), AttrSource(v.source, name))
        return _const_or_wrap(ctx, static)
    if _static_lookup(cls, "__getattr__") is not None:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_ATTRIBUTE, f"{cls.__qualname__} defines __getattr__"
        )
    raise refuse(
        TraceRefusalKind.HOOK_RAISES,
        f"AttributeError: {cls.__qualname__!r} object has no attribute {name!r}",
    )


def _super_attr(ctx: TraceContext, v: SuperV, name: str) -> Value:
    mro = v.self_v.py_type.__mro__
    start = mro.index(v.cls) + 1 if v.cls in mro else len(mro)
    for klass in mro[start:]:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            if isinstance(attr, types.FunctionType) or callable(attr):
                return MethodV(v.self_v, name, attr)
            return _const_or_wrap(ctx, attr)
    raise refuse(TraceRefusalKind.HOOK_RAISES, f"AttributeError: super() has no attribute {name!r}")


def set_attr(ctx: TraceContext, v: Value, name: str, value: Value) -> None:
    """``v.name = value``: a store in the trace's side-effect log."""
    if not isinstance(v, ObjectV):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
            f"setting attribute {name!r} on a {v.py_type.__qualname__}",
        )
    cls = v.py_type
    if v.obj is None or not hasattr(v.obj, "__dict__"):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
            f"setting attribute {name!r} on a {cls.__qualname__} without an instance __dict__",
        )
    if slot(cls, "__setattr__") is not object.__setattr__:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, f"{cls.__qualname__} overrides __setattr__"
        )
    static = _static_lookup(cls, name)
    if static is not None and _is_data_descriptor(static):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, f"{cls.__qualname__}.{name} is a descriptor"
        )
    with ctx.log() as se:
        se.store_attr(v.ref, name, Staged(value))


def del_attr(ctx: TraceContext, v: Value, name: str) -> None:
    """``del v.name``."""
    if not isinstance(v, ObjectV) or slot(v.py_type, "__delattr__") is not object.__delattr__:
        raise refuse(TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT, f"deleting attribute {name!r}")
    get_attr(ctx, v, name, 0)  # AttributeError if it is not there
    with ctx.log() as se:
        se.del_attr(v.ref, name)


# ------------------------------------------------------------------ builtins


@builtin(getattr)
def _getattr(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("getattr", kwargs)
    name = ctx.specialize(args[1])
    try:
        return get_attr(ctx, args[0], name, depth)
    except Refused as exc:
        if (
            len(args) == 3
            and exc.kind is TraceRefusalKind.HOOK_RAISES
            and exc.explanation.startswith("AttributeError")
        ):
            return args[2]
        raise


@builtin(hasattr)
def _hasattr(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("hasattr", kwargs)
    try:
        get_attr(ctx, args[0], ctx.specialize(args[1]), depth)
    except Refused as exc:
        if exc.kind is TraceRefusalKind.HOOK_RAISES and exc.explanation.startswith(
            "AttributeError"
        ):
            return ConstV(False)
        raise
    return ConstV(True)


@builtin(setattr)
def _setattr(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("setattr", kwargs)
    set_attr(ctx, args[0], ctx.specialize(args[1]), args[2])
    return ConstV(None)


@builtin(delattr)
def _delattr(ctx: TraceContext, args: list[Value], kwargs: dict[str, Value], depth: int) -> Value:
    no_kwargs("delattr", kwargs)
    del_attr(ctx, args[0], ctx.specialize(args[1]))
    return ConstV(None)
