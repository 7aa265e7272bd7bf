"""Which collectives run inside a CUDA graph, and why the others stay outside.

A functional collective (``_c10d_functional``: ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, their ``_out`` and coalesced forms,
``all_to_all_single``, ``broadcast``) is captured when the process group its
``group_name`` argument names uses NCCL for the captured device and each of its
results is waited on (``wait_tensor``) in the same graph; a ``wait_tensor`` is
captured when the collective it waits on is. Invariant: a captured collective and
its waits end in one captured segment (:func:`unpaired` names the pairs a plan
split, which the planner then refuses). Everything else in the collective
namespaces keeps a refusal of kind ``COLLECTIVE`` that says why: a group that is
not NCCL (gloo, CPU), a name no group of this process has, the in-place ``c10d``
ops, the legacy ``c10d_functional`` ops, DTensor's own ops.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

import torch
import torch.fx

from loom_cudagraph._reasons import CudagraphRefusalKind
from loom_cudagraph._registry import COLLECTIVE_NAMESPACES, OpRule, collective_rule, op_name
from loom_cudagraph._torch_compat import (
    NO_ARGUMENT,
    OpOverload,
    named_argument,
    process_group_backend,
    process_group_names,
)

__all__ = [
    "CAPTURABLE_BACKENDS",
    "capturable_groups",
    "collective_refusal",
    "is_collective",
    "is_launch",
    "launch_of",
    "unpaired",
    "waits_of",
]

# NOTE: why a captured collective is safe. Functional collectives are out of
# place (their result is a fresh tensor, the input is only read), so a replay
# writes nothing a recording does not own. loom's segment runtime runs each call of
# a segment exactly once in either mode: call 1 is the uncaptured warm-up, the
# recording call captures (which launches nothing) and replays once, later calls
# replay, a skipped call runs uncaptured. So every rank issues each collective once
# per call whatever it decided, and ranks that record at different calls stay in
# step: NCCL allows captured and eager launches on one communicator. Captures use
# ``capture_error_mode="thread_local"`` (``_capture.py``), so NCCL's watchdog
# thread (which queries events) does not invalidate them, and ``wait_tensor`` in a
# capture becomes a stream wait on the collective's end event, recorded in the
# same capture. That event must be recorded in the capture that waits on it (a
# wait on an event recorded elsewhere breaks capture isolation), hence the pairing
# rule: a collective and its waits share one captured segment.

#: Backends whose collectives can be captured in a CUDA graph.
CAPTURABLE_BACKENDS: Final[frozenset[str]] = frozenset({"nccl"})

#: The functional namespace loom captures (group named by ``group_name``).
_FUNCTIONAL = "_c10d_functional"
_WAIT = "_c10d_functional.wait_tensor"
#: Functional ops that launch nothing (no group): identity wrappers.
_NO_WORK = frozenset({"_c10d_functional._wrap_tensor_autograd"})


def is_collective(target: Any) -> bool:
    """Whether ``target`` is an op of a collective namespace (``_c10d_functional``,
    ``c10d_functional``, ``c10d``, ``_dtensor``)."""
    return isinstance(target, OpOverload) and target.namespace in COLLECTIVE_NAMESPACES


def _packet(node: torch.fx.Node) -> str:
    return ".".join(op_name(node.target).split(".")[:2])


def _group_name(node: torch.fx.Node) -> Any:
    """The ``group_name`` argument of a collective call (``NO_ARGUMENT`` if its op has none)."""
    return named_argument(node.target, node.args, node.kwargs, "group_name")


def is_launch(node: torch.fx.Node) -> bool:
    """Whether ``node`` launches a functional collective (its op names a group)."""
    return (
        node.op == "call_function"
        and is_collective(node.target)
        and _packet(node).startswith(f"{_FUNCTIONAL}.")
        and _group_name(node) is not NO_ARGUMENT
    )


def launch_of(wait: torch.fx.Node) -> torch.fx.Node | None:
    """The functional collective whose result ``wait`` waits on (through ``getitem``
    of a coalesced one), or ``None`` (a graph input, another op)."""
    arg = wait.args[0] if wait.args else wait.kwargs.get("tensor")
    while isinstance(arg, torch.fx.Node) and arg.target is operator.getitem:
        arg = arg.args[0]
    return arg if isinstance(arg, torch.fx.Node) and is_launch(arg) else None


def _results(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes holding a collective's results: itself, or each ``getitem`` of a list."""
    if isinstance(node.meta.get("val"), list | tuple):
        return [u for u in node.users if u.target is operator.getitem]
    return [node]


def waits_of(launch: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The ``wait_tensor`` calls on ``launch``'s results, or ``None`` when a result
    is not waited on in this graph (it leaves the graph, waited on elsewhere)."""
    results = _results(launch)
    waits: list[torch.fx.Node] = []
    for r in results or [launch]:
        found = [
            u
            for u in r.users
            if u.op == "call_function" and op_name(u.target) == f"{_WAIT}.default"
        ]
        if not found:
            return None
        waits.extend(found)
    return waits


def _refuse(node: torch.fx.Node, explanation: str, hint: str = "") -> OpRule:
    return OpRule(op_name(node.target), CudagraphRefusalKind.COLLECTIVE, explanation, hint)


def group_refusal(group_name: str, device: torch.device | None) -> str | None:
    """Why the process group ``group_name`` cannot be captured on ``device``, or ``None``."""
    device_type = device.type if device is not None else "cuda"
    try:
        backend = process_group_backend(group_name, device_type)
    except LookupError as exc:
        return f"its process group {group_name!r} cannot be resolved in this process ({exc})"
    if backend not in CAPTURABLE_BACKENDS:
        return (
            f"its process group {group_name!r} uses the {backend} backend for {device_type} "
            "tensors; only NCCL collectives can be captured in a CUDA graph"
        )
    return None


def collective_refusal(
    node: torch.fx.Node, device: torch.device | None, capture: bool = True
) -> OpRule | None:
    """``None`` when the collective ``node`` can run inside a CUDA graph on ``device``,
    else the rule that keeps it outside (kind ``COLLECTIVE``, with the reason).
    ``capture=False`` (``cudagraph_capture_collectives`` off) keeps every collective
    outside, as before collectives were captured."""
    name = op_name(node.target)
    if not capture:
        return collective_rule(name)
    namespace = name.split(".", 1)[0]
    if namespace == "c10d":
        return _refuse(
            node,
            "an in-place c10d collective hands back a Work object that the host waits on; "
            "loom captures functional collectives (_c10d_functional) only",
            "call torch.distributed's collectives in the compiled code (Dynamo turns them "
            "into functional ones) or use torch.distributed._functional_collectives",
        )
    if namespace == "c10d_functional":
        return _refuse(
            node,
            "a legacy functional collective names its group by tag and ranks, which loom does "
            "not resolve; loom captures _c10d_functional collectives only",
            "use torch.distributed._functional_collectives of this torch",
        )
    if namespace != _FUNCTIONAL:
        return _refuse(
            node,
            f"a {namespace} op runs its collective and waits for it inside the op; loom has "
            "not verified that it can be captured",
            "keep it at a segment boundary; the compute around it is captured",
        )
    packet = _packet(node)
    if packet in _NO_WORK:
        return None
    if packet == _WAIT:
        launch = launch_of(node)
        if launch is None:
            return _refuse(
                node,
                "waits on a collective issued outside this graph; a wait is captured only "
                "with its collective, in the same graph",
            )
        why = collective_refusal(launch, device, capture)
        if why is not None:
            return _refuse(
                node, f"waits on {launch.name}, which runs uncaptured: {why.explanation}"
            )
        return None
    group = _group_name(node)
    if group is NO_ARGUMENT:
        return _refuse(node, "it names no process group; loom does not know what it launches")
    if not isinstance(group, str):
        return _refuse(node, f"its process group is not a constant name ({group!r})")
    why_group = group_refusal(group, device)
    if why_group is not None:
        return _refuse(
            node, why_group, "collectives of an NCCL group are captured with the compute"
        )
    if waits_of(node) is None:
        return _refuse(
            node,
            "its result is not waited on in this graph (wait_tensor runs elsewhere); a captured "
            "collective must be waited on in the graph that captures it",
        )
    return None


def unpaired(
    calls: Sequence[torch.fx.Node],
    refused: Collection[torch.fx.Node],
    segment_of: Mapping[torch.fx.Node, int] | None = None,
) -> dict[torch.fx.Node, str]:
    """The collectives and waits to refuse so that each captured collective and its
    waits run together: where one of them is refused (by any rule), and where a plan
    (``segment_of``) put them in different segments; each with its explanation."""
    found: dict[torch.fx.Node, str] = {}
    for launch in calls:
        if not is_launch(launch):
            continue
        group = [launch, *(waits_of(launch) or [])]
        out = [n for n in group if n in refused]
        if out and len(out) < len(group):
            why = (
                f"runs with {out[0].name}, which stays uncaptured: a collective and its waits "
                "are captured together or not at all"
            )
            found.update((n, why) for n in group if n not in refused)
        elif not out and segment_of is not None:
            if len({segment_of[n] for n in group}) > 1:
                why = (
                    f"{launch.name} and its wait fall in different segments (an uncaptured node "
                    "lies between them); a captured collective must be waited on in the graph "
                    "that captures it"
                )
                found.update((n, why) for n in group)
    return found


def capturable_groups(device_type: str) -> tuple[str, ...]:
    """The names of this process's groups whose collectives are captured on
    ``device_type`` (their backend is NCCL), sorted: with the group names a graph
    holds, what decides which of its collectives are captured (a cache key reads it).

    >>> capturable_groups("cuda")  # doctest: +SKIP
    ('0',)
    """
    found = []
    for name in process_group_names():
        try:
            backend = process_group_backend(name, device_type)
        except LookupError:
            continue
        if backend in CAPTURABLE_BACKENDS:
            found.append(name)
    return tuple(found)
