"""Hook graphs: a saved-tensor hook pair traced at one saved tensor's fake value.

A :class:`HookGraphs` source turns the user's ``(pack, unpack)`` into two aten
graphs for each tensor the partitioner saves: the pack graph at that tensor's
own dtype, shape and device (so a hook that decides per tensor decides once
per saved tensor), and the unpack graph at the pack graph's outputs. Graphs
are functionalized and traced under the saved value's fake mode, so symbolic
sizes stay symbolic. ``GraphModule`` hooks need no tracer; Python hooks go
through a :class:`HookTracer` (``loom_tracer``) or are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.fx

from loom_hops import _torch_compat
from loom_hops._hook_match import HookMismatch, static_mismatch
from loom_hops._hook_pair import HookPair
from loom_hops._torch_compat import FakeTensor, fake_mode_of, make_fx, python_dispatcher, pytree
from loom_hops._unsupported import HopsRefusalKind, Unsupported

__all__ = [
    "GraphModuleHooks",
    "HookGraphs",
    "LiftedInput",
    "PackedLayout",
    "TracedPack",
    "TracedUnpack",
    "trace_function",
]

Decompositions = Mapping[Any, Callable[..., Any]]
#: Replays a traced hook's side effects on the closure and globals of a pair's hooks.
HookEffects = Callable[[HookPair], None]


@dataclasses.dataclass(frozen=True, slots=True)
class PackedLayout:
    """How a pack hook's result is laid out: its pytree spec and, per leaf, what it is.

    ``kinds[i]`` is ``"tensor"``, ``"symint"`` or ``"constant"``; constants (a dtype,
    an int) are folded into the unpack graph and do not cross to the backward.
    """

    spec: pytree.TreeSpec
    kinds: tuple[str, ...]
    constants: tuple[Any, ...]

    def check(self) -> None:
        if len(self.kinds) != len(self.constants):
            raise AssertionError("PackedLayout: kinds and constants differ in length")
        for kind, const in zip(self.kinds, self.constants, strict=True):
            if kind not in ("tensor", "symint", "constant"):
                raise AssertionError(f"PackedLayout: unknown leaf kind {kind!r}")
            if (kind == "constant") == (const is None) and const is not None:
                raise AssertionError("PackedLayout: constant slot mismatch")


@dataclasses.dataclass(frozen=True, slots=True)
class LiftedInput:
    """A value a hook reads from outside its arguments at each call, as a graph input:
    a float or int of its closure, globals or an object (a 0-d tensor), or a tensor
    there. ``read(pair)`` gives this call's value from the active pair's closure and
    globals; inputs with the same ``key`` (role, source, dtype, device) are one."""

    key: str
    example: torch.Tensor  # a fake value, in the saved tensors' fake mode
    read: Callable[[HookPair], torch.Tensor] = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class TracedPack:
    """The pack graph for one saved tensor: ``graph(saved, *lifted) -> flat leaves``,
    and their layout."""

    graph: torch.fx.GraphModule
    layout: PackedLayout
    example_outputs: tuple[Any, ...]
    #: The hook's side effects for this tensor, replayed after the compiled forward
    #: on the state of the pair given (the pair active at that call).
    effects: HookEffects | None = None
    fingerprint: str | None = None
    #: The graph's inputs after the saved tensor: values read at each call.
    lifted: tuple[LiftedInput, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class TracedUnpack:
    """The unpack graph for one saved tensor: ``graph(*crossing, *lifted) -> (tensor,)``."""

    graph: torch.fx.GraphModule
    #: The hook's side effects for this tensor, replayed after the compiled backward
    #: on the state of the pair given (the compiled pair: a matching pair's unpack
    #: effects mutate the same objects).
    effects: HookEffects | None = None
    #: The graph's inputs after the packed value: read at the forward, when the pair
    #: is known, and carried to the backward as saved values.
    lifted: tuple[LiftedInput, ...] = ()
    #: The unpacked tensor's fake value: its strides may differ from the saved
    #: tensor's (``save_on_cpu`` packs into a contiguous buffer).
    example_output: torch.Tensor | None = None


class HookGraphs(Protocol):
    """Something that traces a pack/unpack pair at a given saved value."""

    @property
    def description(self) -> str:
        """Short description for reports ("GraphModule hooks", "traced Python hooks")."""
        ...

    def trace_pack(self, saved: torch.Tensor) -> TracedPack | Unsupported: ...

    def trace_unpack(self, pack: TracedPack, saved: torch.Tensor) -> TracedUnpack | Unsupported: ...

    def mismatch(self, active: HookPair | None) -> HookMismatch | None:
        """Why the traces made so far do not serve ``active`` (the pair active at a
        call), or ``None``: see :func:`loom_hops.pair_mismatch`."""
        ...


def trace_function(
    fn: Callable[..., Any],
    example_args: Sequence[Any],
    decompositions: Decompositions | None = None,
) -> torch.fx.GraphModule:
    """Functionalize and trace ``fn`` to an aten graph at ``example_args`` (fake values).

    Runs under the fake mode that owns the examples, with the Python dispatcher,
    as AOTAutograd traces its own graphs; symbolic sizes stay symbolic.
    """
    mode = fake_mode_of(example_args)
    functional = torch.func.functionalize(fn, remove="mutations_and_views")
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx, python_dispatcher():
        return make_fx(functional, decomposition_table=dict(decompositions or {}))(*example_args)


def _classify(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.SymInt):
        return "symint"
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return "unsupported"
    return "constant"


def layout_of(packed: Any, where: str) -> PackedLayout | Unsupported:
    """The :class:`PackedLayout` of a pack result, or why it cannot cross to backward."""
    leaves, spec = pytree.tree_flatten(packed)
    kinds: list[str] = []
    constants: list[Any] = []
    for leaf in leaves:
        kind = _classify(leaf)
        if kind == "unsupported":
            return Unsupported(
                HopsRefusalKind.UNSUPPORTED_PACKED_VALUE,
                where,
                f"the pack hook returned a {type(leaf).__name__}; only tensors, SymInts "
                "and constants can cross from forward to backward",
                "return tensors, sizes or Python constants from the pack hook",
            )
        if kind == "tensor" and type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            if not isinstance(leaf, FakeTensor):
                return Unsupported(
                    HopsRefusalKind.UNSUPPORTED_PACKED_VALUE,
                    where,
                    f"the pack hook returned a tensor subclass {type(leaf).__name__}",
                    "return the subclass's inner tensors and rebuild it in unpack",
                )
        kinds.append(kind)
        constants.append(leaf if kind == "constant" else None)
    return PackedLayout(spec, tuple(kinds), tuple(constants))


@dataclasses.dataclass(frozen=True)
class GraphModuleHooks:
    """``(pack, unpack)`` given as ``torch.fx.GraphModule``s: retraced, never run at compile.

    >>> hooks = GraphModuleHooks(pack_gm, unpack_gm)
    >>> traced = hooks.trace_pack(fake_saved)      # aten graph at this tensor's meta
    """

    pack: torch.fx.GraphModule
    unpack: torch.fx.GraphModule
    decompositions: Decompositions | None = None
    description: str = "GraphModule hooks"

    def trace_pack(self, saved: torch.Tensor) -> TracedPack | Unsupported:
        return trace_pack_graph(self.pack, saved, self.decompositions)

    def trace_unpack(self, pack: TracedPack, saved: torch.Tensor) -> TracedUnpack | Unsupported:
        return trace_unpack_graph(self.unpack, pack, saved, self.decompositions)

    def mismatch(self, active: HookPair | None) -> HookMismatch | None:
        return static_mismatch(HookPair(self.pack, self.unpack), active)


def trace_pack_graph(
    pack: Callable[..., Any],
    saved: torch.Tensor,
    decompositions: Decompositions | None,
    *,
    where: str | None = None,
    lifted: Sequence[LiftedInput] = (),
) -> TracedPack | Unsupported:
    """Trace ``pack`` once at ``saved``; constants in its result are recorded, not returned.
    ``where`` names the user's hook in refusals (default: ``pack``'s own name);
    ``pack(saved, *lifted)`` takes the lifted values as graph inputs."""
    where = where or f"pack hook {_name(pack)}"
    layouts: list[PackedLayout | Unsupported] = []

    def flat_pack(x: torch.Tensor, *extra: torch.Tensor) -> tuple[Any, ...]:
        result = pack(x, *extra)
        layout = layout_of(result, where)
        layouts.append(layout)
        if isinstance(layout, Unsupported):
            return (x,)
        leaves = pytree.tree_leaves(result)
        return tuple(leaf for leaf, k in zip(leaves, layout.kinds, strict=True) if k != "constant")

    examples = [saved, *(x.example for x in lifted)]
    try:
        graph = trace_function(flat_pack, examples, decompositions)
    except _torch_compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as e:
        return _trace_failed(where, e)
    layout = layouts[-1]
    if isinstance(layout, Unsupported):
        return layout
    mode = fake_mode_of([saved])
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx, python_dispatcher():
        outs = tuple(graph(*examples))
    return TracedPack(graph, layout, outs, lifted=tuple(lifted))


def rebuild_packed(layout: PackedLayout, crossing: Sequence[Any]) -> Any:
    """The pack result with constants restored from ``layout`` and the rest from ``crossing``."""
    it = iter(crossing)
    leaves = [
        c if k == "constant" else next(it)
        for k, c in zip(layout.kinds, layout.constants, strict=True)
    ]
    return pytree.tree_unflatten(leaves, layout.spec)


def trace_unpack_graph(
    unpack: Callable[[Any], Any],
    pack: TracedPack,
    saved: torch.Tensor,
    decompositions: Decompositions | None,
    *,
    where: str | None = None,
    lifted: Sequence[LiftedInput] = (),
) -> TracedUnpack | Unsupported:
    """Trace ``unpack`` at the pack outputs; check it gives back ``saved``'s dtype/shape/device.
    ``where`` names the user's hook in refusals (default: ``unpack``'s own name);
    ``unpack(packed, *lifted)`` takes the lifted values as graph inputs."""
    where = where or f"unpack hook {_name(unpack)}"
    num_crossing = len(pack.example_outputs)

    def flat_unpack(*inputs: Any) -> Any:
        crossing, extra = inputs[:num_crossing], inputs[num_crossing:]
        return unpack(rebuild_packed(pack.layout, crossing), *extra)

    examples = [*pack.example_outputs, *(x.example for x in lifted)]
    try:
        graph = trace_function(flat_unpack, examples, decompositions)
        mode = fake_mode_of([saved])
        ctx = mode if mode is not None else contextlib.nullcontext()
        with ctx, python_dispatcher():
            result = graph(*examples)
    except _torch_compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as e:
        return _trace_failed(where, e)
    if isinstance(result, (tuple, list)):
        if len(result) != 1:
            return Unsupported(
                HopsRefusalKind.BAD_UNPACK_RESULT,
                where,
                f"the unpack hook returned {len(result)} values; it must return one tensor",
            )
        result = result[0]
    if not isinstance(result, torch.Tensor):
        return Unsupported(
            HopsRefusalKind.BAD_UNPACK_RESULT,
            where,
            f"the unpack hook returned {type(result).__name__}, not a tensor",
        )
    if (result.dtype, result.device) != (saved.dtype, saved.device) or list(result.shape) != list(
        saved.shape
    ):
        return Unsupported(
            HopsRefusalKind.UNPACK_MISMATCH,
            where,
            f"unpack gave {result.dtype}{list(result.shape)} on {result.device} for a saved "
            f"{saved.dtype}{list(saved.shape)} on {saved.device}",
            "make unpack restore the saved tensor's dtype, shape and device",
        )
    _flatten_output(graph)
    return TracedUnpack(graph, lifted=tuple(lifted), example_output=result)


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__name__))


def _flatten_output(graph: torch.fx.GraphModule) -> None:
    out = graph.graph.output_node()
    value = out.args[0]
    if not isinstance(value, (tuple, list)):
        out.args = ((value,),)
        graph.recompile()


def _trace_failed(where: str, error: Exception) -> Unsupported:
    return Unsupported(
        HopsRefusalKind.HOOK_TRACE_FAILED,
        where,
        f"tracing the hook at a saved tensor failed: {type(error).__name__}: {error}",
        "keep hooks to tensor operations; wrap opaque parts with torch.fx.wrap",
    )
