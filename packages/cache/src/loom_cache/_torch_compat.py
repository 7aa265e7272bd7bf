"""The only door from ``loom_cache`` to private torch APIs (pinned torch 2.11).

Everything here is read-only introspection: the shape environment behind a
fake tensor, the sources of a symbol, the Python implementations registered
for a custom operator, and the portable part of Inductor's and functorch's
configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def shape_env_of(value: object) -> Any | None:
    """The ``ShapeEnv`` behind a fake tensor or a SymInt/SymFloat, if any."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return getattr(value.node, "shape_env", None)
    fake_mode = getattr(value, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def symbol_source_names(shape_env: Any, symbol: Any) -> list[str]:
    """The names of the sources a symbol was created from (``L['x'].size()[0]``)."""
    sources = getattr(shape_env, "var_to_sources", {}).get(symbol, [])
    names = []
    for source in sources:
        name = source.name
        names.append(name() if callable(name) else str(name))
    return names


def custom_op_implementations(
    op: torch._ops.OpOverload,
) -> Iterator[tuple[str, Callable[..., Any]]]:
    """The Python functions that define a ``torch.library.custom_op``: its kernel
    per device, fake (abstract) implementation, autograd formula, vmap rule."""
    from torch._library.custom_ops import OPDEFS

    qualname = op._schema.name  # "ns::name"
    opdef = OPDEFS.get(qualname)
    if opdef is None:
        return
    yield "init", opdef._init_fn
    for device, fn in sorted(opdef._backend_fns.items(), key=lambda kv: str(kv[0])):
        yield f"kernel:{device}", getattr(fn, "__wrapped__", fn)
    for label, fn in (
        ("fake", opdef._abstract_fn),
        ("setup_context", opdef._setup_context_fn),
        ("backward", opdef._backward_fn),
        ("vmap", opdef._vmap_fn),
    ):
        if fn is not None:
            yield label, fn


def op_schema(op: torch._ops.OpOverload) -> str:
    return str(op._schema)


def is_op_overload(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def is_op_packet(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverloadPacket)


def is_higher_order_op(target: object) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def hop_name(op: Any) -> str:
    return str(op.name())


def inductor_config() -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    return dict(inductor_config.save_config_portable())


def functorch_config() -> dict[str, Any]:
    import torch._functorch.config as functorch_config

    return dict(functorch_config.save_config_portable())
