"""The registry of operators that must run outside a CUDA graph.

Built-in rules (sync ops, data-dependent shapes, RNG-state wrappers) sit
beside user rules added with :func:`mark_non_capturable`; collectives are
decided by their process group (``_collectives``), with :func:`collective_rule`
for those left outside whatever their group. An
operator is named by its qualified overload name (``"aten.nonzero.default"``)
or its packet name (``"mylib.my_op"``, matching every overload). Ops that
carry ``torch.Tag.cudagraph_unsafe`` (for example through
``torch.library.custom_op(..., tags=(torch.Tag.cudagraph_unsafe,))``) are
non-capturable without registration.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from loom_cudagraph._reasons import CudagraphRefusalKind
from loom_cudagraph._torch_compat import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = [
    "OpRule",
    "collective_rule",
    "lookup_rule",
    "mark_non_capturable",
    "op_name",
    "registered_rule",
    "registered_rules",
    "unmark_non_capturable",
]


@dataclasses.dataclass(frozen=True, slots=True)
class OpRule:
    """Why one operator (or every overload of a packet) runs uncaptured."""

    name: str
    kind: CudagraphRefusalKind
    explanation: str
    hint: str = ""


#: Namespaces whose every op is a collective.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})

_BUILTIN: tuple[OpRule, ...] = (
    OpRule(
        "aten._local_scalar_dense",
        CudagraphRefusalKind.SYNC_OP,
        "reads a device value on the host (.item()), which synchronizes",
        "keep the value on the device (torch.where instead of an if on .item())",
    ),
    OpRule(
        "aten.item",
        CudagraphRefusalKind.SYNC_OP,
        "reads a device value on the host, which synchronizes",
    ),
    OpRule(
        "aten.equal", CudagraphRefusalKind.SYNC_OP, "returns a host bool computed from device data"
    ),
    OpRule(
        "aten.is_nonzero",
        CudagraphRefusalKind.SYNC_OP,
        "returns a host bool computed from device data",
    ),
    OpRule(
        "aten._assert_scalar",
        CudagraphRefusalKind.SYNC_OP,
        "asserts on a host value read from the device",
    ),
    OpRule(
        "aten._fused_moving_avg_obs_fq_helper",
        CudagraphRefusalKind.USER_MARKED,
        "branches on device state on the host (quantization observer)",
    ),
    OpRule(
        "aten._fused_moving_avg_obs_fq_helper_functional",
        CudagraphRefusalKind.USER_MARKED,
        "branches on device state on the host (quantization observer)",
    ),
    OpRule(
        "run_and_save_rng_state",
        CudagraphRefusalKind.RNG_STATE,
        "saves the RNG state on the host, which a replay would not redo",
        "leave functionalize_rng_ops off (the default)",
    ),
    OpRule(
        "run_with_rng_state",
        CudagraphRefusalKind.RNG_STATE,
        "restores an RNG state on the host, which a replay would not redo",
        "leave functionalize_rng_ops off (the default)",
    ),
    OpRule("cond", CudagraphRefusalKind.CONTROL_FLOW, "torch.cond picks a branch on the host"),
    OpRule(
        "while_loop",
        CudagraphRefusalKind.CONTROL_FLOW,
        "torch.while_loop tests its condition on the host",
    ),
)

_lock = threading.Lock()
_user_rules: dict[str, OpRule] = {}
_builtin_rules: dict[str, OpRule] = {r.name: r for r in _BUILTIN}


def op_name(target: Any) -> str:
    """The qualified name of an FX call target: ``aten.add.Tensor``, ``cond``, ``operator.getitem``."""
    if isinstance(target, OpOverload | OpOverloadPacket | HigherOrderOperator):
        return str(target)
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    qual = (
        getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    )
    return f"{module.removeprefix('_')}.{qual}" if module else str(qual)


def _packet_name(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else name


def _normalize(op: Any) -> str:
    name = op_name(op) if not isinstance(op, str) else op
    return name.replace("::", ".")


def mark_non_capturable(
    op: Any,
    explanation: str = "marked non-capturable by the user",
    hint: str = "",
    kind: CudagraphRefusalKind = CudagraphRefusalKind.USER_MARKED,
) -> OpRule:
    """Make every call of ``op`` run outside CUDA graphs, with this reason.

    ``op`` is an ``OpOverload``, an ``OpOverloadPacket`` (all overloads) or a
    name such as ``"mylib::my_op"`` / ``"mylib.my_op.default"``.

    >>> mark_non_capturable(torch.ops.aten.nonzero, "my reason")  # doctest: +SKIP
    """
    rule = OpRule(_normalize(op), kind, explanation, hint)
    with _lock:
        _user_rules[rule.name] = rule
    return rule


def unmark_non_capturable(op: Any) -> None:
    """Remove a rule added with :func:`mark_non_capturable` (no error if absent)."""
    with _lock:
        _user_rules.pop(_normalize(op), None)


def registered_rules() -> Iterator[OpRule]:
    """Built-in rules, then user rules (a user rule for the same name wins)."""
    with _lock:
        merged = {**_builtin_rules, **_user_rules}
    yield from merged.values()


def registered_rule(target: Any) -> OpRule | None:
    """The rule of the user registry, the built-in table or ``torch.Tag.cudagraph_unsafe``
    that makes ``target`` non-capturable, or ``None`` (collectives are decided apart,
    ``loom_cudagraph._collectives``)."""
    name = op_name(target)
    packet = _packet_name(name)
    with _lock:
        for table in (_user_rules, _builtin_rules):
            rule = table.get(name) or table.get(packet)
            if rule is not None:
                return rule
    if isinstance(target, OpOverload) and torch.Tag.cudagraph_unsafe in target.tags:
        return OpRule(
            name, CudagraphRefusalKind.USER_MARKED, "the op carries torch.Tag.cudagraph_unsafe"
        )
    return None


def collective_rule(name: str) -> OpRule:
    """The rule of a collective left outside CUDA graphs whatever its group
    (``cudagraph_capture_collectives`` off)."""
    return OpRule(
        name,
        CudagraphRefusalKind.COLLECTIVE,
        "collectives run outside CUDA graphs in loom",
        "keep collectives at segment boundaries; the compute around them is captured",
    )


def lookup_rule(target: Any) -> OpRule | None:
    """The rule that makes ``target`` non-capturable whatever its arguments, or ``None``.

    Order: user registry, built-in table, ``torch.Tag.cudagraph_unsafe``,
    collective namespaces (every collective, as with ``cudagraph_capture_collectives``
    off; the planner decides collectives by their group, ``_collectives``).
    """
    rule = registered_rule(target)
    if (
        rule is None
        and isinstance(target, OpOverload)
        and target.namespace in COLLECTIVE_NAMESPACES
    ):
        return collective_rule(op_name(target))
    return rule
