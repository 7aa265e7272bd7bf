"""Placement of saved-tensor hooks in a partitioned forward/backward pair.

For each tensor the partitioner saves, the pack graph is invoked (as a
``loom_saved_tensor_pack`` node) right after the tensor's last forward use and
its leaves replace the tensor among the forward's saved outputs; the unpack
graph is invoked (``loom_saved_tensor_unpack``) right before the tensor's first
backward use, fed by new backward placeholders, and its result is copied to the
saved tensor's strides when it has others (``prims.copy_strided``). Saved values are matched to
backward inputs by position, as AOTAutograd's runtime passes them (the
partitioner may rename one: the RNG state of a recomputed random op is
``getitem_N`` in the forward and ``rng_state_output_N`` in the backward).
Invariant after the pass: the forward's saved outputs and the backward's saved
inputs line up one to one, with the same metadata, symbolic sizes after tensors
in the forward and before them in the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from loom_hops._hook_graphs import HookEffects, HookGraphs, LiftedInput, TracedPack, TracedUnpack
from loom_hops._hook_hops import pack_hook_op, unpack_hook_op
from loom_hops._torch_compat import (
    fake_mode_of,
    in_checkpointed_region,
    is_rng_state_output,
    is_sdpa_philox_output,
    is_sym_node,
    is_view_op,
    statically_known_true,
)
from loom_hops._unsupported import HopsRefusalKind, Unsupported

__all__ = [
    "PackScope",
    "PackedTensor",
    "Placement",
    "SavedOrigin",
    "count_forward_outputs",
    "place_saved_tensor_hooks",
]

log = logging.getLogger("torchloom.hops")


class PackScope(enum.Enum):
    """Which saved tensors get packed."""

    #: Every tensor eager autograd would pack: inputs and parameters included (default).
    ALL = "all"
    #: Only intermediates (not graph inputs, not outputs): PyTorch's own default.
    ACTIVATIONS = "activations"


class SavedOrigin(enum.Enum):
    """Where a saved tensor comes from in the forward graph."""

    #: An intermediate: neither a graph input nor a user output.
    ACTIVATION = "activation"
    #: A graph input (a parameter, a buffer or an argument).
    INPUT = "input"
    #: Also one of the forward's user outputs.
    OUTPUT = "output"


@dataclasses.dataclass(frozen=True, slots=True)
class PackedTensor:
    """One saved tensor the placement packed, in forward save order."""

    name: str
    origin: SavedOrigin
    dtype: str
    shape: tuple[str, ...]
    device: str
    crossing: tuple[str, ...]  # names of the packed leaves that go to the backward
    pack_after: str  # the forward node after which the pack runs (last use)
    unpack_before: str  # the backward node before which the unpack runs (first use)
    #: The device of each crossing leaf ("" for a size): another device than ``device``
    #: means the pack moves the tensor there (CPU offload) and the unpack copies it back.
    crossing_devices: tuple[str, ...] = ()

    @property
    def moves_device(self) -> bool:
        """Whether the packed value lives on another device than the saved tensor."""
        return any(d and d != self.device for d in self.crossing_devices)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """The rewritten pair, what was packed, and what was left as it is (with why)."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    num_fwd_outputs: int
    packed: tuple[PackedTensor, ...]
    kept: tuple[tuple[str, str], ...]  # (saved tensor, reason)
    #: Side effects of traced Python pack hooks, one per packed tensor that has any,
    #: in eager's order: the op that first consumes each tensor, then argument order.
    #: Each is called with the pair active at the call (whose state it mutates).
    pack_effects: tuple[HookEffects, ...] = ()
    #: Side effects of traced unpack hooks, in the backward order of the unpacks;
    #: each is called with the compiled pair.
    unpack_effects: tuple[HookEffects, ...] = ()
    #: Values the hooks read at each call (a per-step scale): the forward's last
    #: inputs, in order, which the caller appends (``read(active_pair)``) to the
    #: forward's arguments; those the unpacks use are saved for the backward.
    lifted: tuple[LiftedInput, ...] = ()

    @property
    def moved(self) -> tuple[str, ...]:
        """The packed tensors whose packed value lives on another device (offloaded).

        Their unpack copies back from a graph input of the backward. A code
        generator that reorders for peak memory without telling devices apart
        (Inductor 2.11 counts host buffers as device memory) may hoist those
        copies to the start of the backward; keep such graphs in their order.
        """
        return tuple(p.name for p in self.packed if p.moves_device)

    def check(self) -> None:
        """Verify the forward's saved outputs and the backward's saved inputs line up."""
        self.forward.graph.lint()  # type: ignore[no-untyped-call]
        self.backward.graph.lint()  # type: ignore[no-untyped-call]
        saved = list(self.forward.graph.output_node().args[0])[self.num_fwd_outputs :]  # type: ignore[arg-type, index]
        tensors = [n for n in saved if not is_sym_node(n)]
        syms = [n for n in saved if is_sym_node(n)]
        if saved != tensors + syms:
            raise AssertionError("Placement: symbolic sizes must follow tensors in forward outputs")
        ins = [n for n in self.backward.graph.nodes if n.op == "placeholder"]
        expected = syms + tensors
        got = ins[: len(expected)]
        if len(got) != len(expected) or any(
            _mismatch(f, b) is not None for f, b in zip(expected, got, strict=True)
        ):
            raise AssertionError(
                f"Placement: forward saves {[n.name for n in expected]} "
                f"but backward takes {[n.name for n in ins]}"
            )
        for node in (*self.forward.graph.nodes, *self.backward.graph.nodes):
            if node.op == "call_function" and node.target in (pack_hook_op, unpack_hook_op):
                for user in node.users:
                    if user.target is not operator.getitem:
                        raise AssertionError(f"Placement: {node.name} used by {user.name}")


def _origin(node: torch.fx.Node, inner: set[torch.fx.Node]) -> SavedOrigin:
    if node.op == "placeholder":
        return SavedOrigin.INPUT
    if node in inner:
        return SavedOrigin.OUTPUT
    return SavedOrigin.ACTIVATION


def _last_use(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = [u for u in node.users if u.op != "output"]
    last = max(users, key=order.__getitem__, default=node)
    if last.op == "placeholder":
        placeholders: list[torch.fx.Node] = [n for n in graph.nodes if n.op == "placeholder"]
        return placeholders[-1]
    return last


def _pack_anchor(graph: torch.fx.Graph, saved: torch.fx.Node) -> torch.fx.Node:
    """The node after which ``saved`` is packed: the last forward use of its storage.

    A saved view (``t``, ``permute``, ``detach`` of an activation) is often made by
    the partitioner at the end of the forward, only to be saved; packed after that
    view, the full-size base it views would stay alive through the whole forward.
    Its storage's last use is the last op that reads the base or any alias of it
    (views are not uses), so the view ops made only for saving are moved there and
    the pack follows them, as eager packs a saved view of a tensor it frees early.
    """
    chain = [saved]  # the views that lead to ``saved`` and are used only to be saved
    while (
        _is_view(chain[0])
        and isinstance(chain[0].args[0], torch.fx.Node)
        and all(u.op == "output" or u in chain for u in chain[0].users)
    ):
        chain.insert(0, chain[0].args[0])
    root = chain.pop(0)
    if not chain:
        return _last_use(graph, saved)
    while _is_view(root) and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    order = {n: i for i, n in enumerate(graph.nodes)}
    uses = [n for n in _storage_users(root) if n not in chain]
    storage_last = max(uses, key=order.__getitem__, default=root)
    if storage_last.op == "placeholder":
        storage_last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    inputs = {i for n in chain for i in n.all_input_nodes if i not in chain}
    if order[saved] < order[storage_last] or any(order[i] > order[storage_last] for i in inputs):
        return max(_last_use(graph, saved), storage_last, key=order.__getitem__)
    prev = storage_last
    for node in chain:
        prev.append(node)
        prev = node
    log.debug("place_saved_tensor_hooks: %s made after %s", saved.name, storage_last.name)
    return saved


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_view_op(node.target)


def _storage_users(base: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``base`` directly or through views of it (not the views,
    not the graph output)."""
    users: list[torch.fx.Node] = []
    todo = [base]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.op == "output":
                continue
            if _is_view(user) and user.args[0] is node:
                todo.append(user)
            else:
                users.append(user)
    return users


def _device_of(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    return str(val.device) if isinstance(val, torch.Tensor) else ""


def _first_use(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    first: torch.fx.Node = min(node.users, key=order.__getitem__)
    return first


def _node_named(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node | None:
    return next((n for n in gm.graph.nodes if n.name == name), None)


def _fresh(gm: torch.fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _names(*graphs: torch.fx.Graph) -> set[str]:
    return {n.name for g in graphs for n in g.nodes}


def _unique(taken: set[str], base: str) -> str:
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _insert_pack(
    fw: torch.fx.GraphModule,
    saved: torch.fx.Node,
    traced: TracedPack,
    taken: set[str],
    lifted: list[torch.fx.Node],
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    graph = fw.graph
    anchor = _pack_anchor(graph, saved)
    attr = _fresh(fw, f"pack_{saved.name}")
    fw.add_submodule(attr, traced.graph)
    with graph.inserting_after(anchor):
        get = graph.get_attr(attr)
    with graph.inserting_after(get):
        call = graph.call_function(pack_hook_op, (get, saved, *lifted))
    call.meta["val"] = traced.example_outputs
    call.meta["loom_pass"] = "place_saved_tensor_hooks"
    leaves: list[torch.fx.Node] = []
    prev = call
    for i, value in enumerate(traced.example_outputs):
        with graph.inserting_after(prev):
            leaf = graph.create_node(
                "call_function",
                operator.getitem,
                (call, i),
                name=_unique(taken, f"{saved.name}_packed_{i}"),
            )
        leaf.meta["val"] = value
        leaf.meta["loom_pass"] = "place_saved_tensor_hooks"
        leaves.append(leaf)
        prev = leaf
    return anchor, leaves


def _insert_unpack(
    bw: torch.fx.GraphModule,
    placeholder: torch.fx.Node,
    unpack: TracedUnpack,
    leaves: list[torch.fx.Node],
    sym_anchor: list[torch.fx.Node],
    lifted: list[torch.fx.Node],
) -> torch.fx.Node | None:
    graph = bw.graph
    inputs: list[torch.fx.Node] = []
    for leaf in leaves:
        sym = isinstance(leaf.meta["val"], torch.SymInt)
        if sym:
            # NOTE: packed sizes go first, in forward order, before the saved sizes.
            first = next(n for n in graph.nodes if n.op == "placeholder")
            where = (
                graph.inserting_after(sym_anchor[-1])
                if sym_anchor
                else graph.inserting_before(first)
            )
        else:
            where = graph.inserting_before(placeholder)
        with where:
            new = graph.placeholder(leaf.name)
        if new.name != leaf.name:
            raise AssertionError(f"backward already has a node named {leaf.name}")
        new.meta = dict(leaf.meta)
        if sym:
            sym_anchor.append(new)
        inputs.append(new)
    if not placeholder.users:
        graph.erase_node(placeholder)
        return None
    first = _first_use(graph, placeholder)
    attr = _fresh(bw, f"unpack_{placeholder.name}")
    bw.add_submodule(attr, unpack.graph)
    saved = placeholder.meta["val"]
    restride = _restride_to(saved, unpack.example_output)
    unpacked = unpack.example_output if unpack.example_output is not None else saved
    with graph.inserting_before(first):
        get = graph.get_attr(attr)
        call = graph.call_function(unpack_hook_op, (get, *inputs, *lifted))
        out = graph.call_function(operator.getitem, (call, 0))
    call.meta["val"] = (unpacked,)
    out.meta = {**placeholder.meta, "val": unpacked, "loom_pass": "place_saved_tensor_hooks"}
    call.meta["loom_pass"] = "place_saved_tensor_hooks"
    if restride is not None:
        # NOTE: the backward was traced with the saved tensor's strides (a view there
        # may rely on them); an unpack that returns other strides is copied back.
        with graph.inserting_after(out):
            out = graph.call_function(torch.ops.prims.copy_strided.default, (out, restride))
        out.meta = {**placeholder.meta, "loom_pass": "place_saved_tensor_hooks"}
    placeholder.replace_all_uses_with(out)
    graph.erase_node(placeholder)
    return first


def _restride_to(saved: Any, unpacked: torch.Tensor | None) -> list[Any] | None:
    """The strides to copy the unpacked tensor to, or ``None`` when its own will do.

    The target is the saved tensor's strides when it is dense, else dense strides in
    its stride order (a slice of a wider tensor is not re-widened); dimensions of
    size one are ignored, as their strides never matter.
    """
    if not isinstance(saved, torch.Tensor) or unpacked is None:
        return None
    mode = fake_mode_of([saved])
    with mode if mode is not None else contextlib.nullcontext():
        target = list(torch.empty_like(saved, memory_format=torch.preserve_format).stride())
    same = all(
        statically_known_true(size == 1) or statically_known_true(want == got)
        for size, want, got in zip(saved.shape, target, unpacked.stride(), strict=True)
    )
    return None if same else target


def count_forward_outputs(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> int:
    """How many of the forward's outputs are the user's (the rest are saved for backward).

    The backward's leading placeholders are the saved values; its tangents
    (``tangents_N``) follow them. A node both returned and saved appears twice
    among the outputs, so counting the saved block from the end stays exact.
    Without tangents, the saved block is the leading placeholders named as
    forward outputs. AOTAutograd passes the exact count to the partition step
    (``num_fwd_outputs``): prefer it.
    """
    outs = list(forward.graph.output_node().args[0])  # type: ignore[arg-type]
    ins = [n for n in backward.graph.nodes if n.op == "placeholder"]
    tangent = next((i for i, n in enumerate(ins) if n.name.startswith("tangents")), None)
    if tangent is not None:
        return len(outs) - tangent
    out_names = {n.name for n in outs if isinstance(n, torch.fx.Node)}
    saved = 0
    for node in ins:
        if node.name not in out_names:
            break
        saved += 1
    return len(outs) - saved


def _mismatch(saved: torch.fx.Node, given: torch.fx.Node) -> str | None:
    """Why backward input ``given`` cannot be forward output ``saved`` (``None``: it can).

    The same name is the partitioner's own match; a renamed one must agree in
    kind (size or tensor), dtype, rank and device.
    """
    if saved.name == given.name:
        return None
    if is_sym_node(saved) != is_sym_node(given):
        return f"{saved.name} and {given.name} are not both sizes"
    want, got = saved.meta.get("val"), given.meta.get("val")
    if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
        return f"{saved.name} and {given.name} are not both tensors"
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        if (want.dtype, want.dim(), want.device) != (got.dtype, got.dim(), got.device):
            return (
                f"{saved.name} is {want.dtype}/{want.dim()}d/{want.device}, "
                f"{given.name} is {got.dtype}/{got.dim()}d/{got.device}"
            )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _SavedLayout:
    """The partitioner's output layout: user outputs, then saved tensors, then saved sizes."""

    output: torch.fx.Node
    inner: list[Any]
    saved_tensors: list[torch.fx.Node]
    saved_syms: list[torch.fx.Node]
    #: The backward placeholder of each saved value (sizes and tensors), by position.
    backward_inputs: dict[torch.fx.Node, torch.fx.Node]


#: One saved tensor to pack: the forward node, its pack trace and its unpack trace.
_Plan = tuple[torch.fx.Node, TracedPack, TracedUnpack]


def place_saved_tensor_hooks(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    *,
    num_fwd_outputs: int | None = None,
    hooks: HookGraphs,
    scope: PackScope = PackScope.ALL,
    static_input_indices: Sequence[int] = (),
) -> Placement | Unsupported:
    """Pack each saved tensor after its last forward use, unpack before its first backward use.

    ``forward``/``backward`` come straight from the partitioner (the forward
    returns ``num_fwd_outputs`` user outputs, then saved tensors, then saved
    sizes; the backward takes saved sizes, saved tensors, then tangents). Both
    are rewritten in place. On refusal nothing has been changed.
    ``num_fwd_outputs`` defaults to :func:`count_forward_outputs`.
    ``static_input_indices`` are the forward inputs that are parameters or
    buffers (the partitioner's ``static_lifetime_input_indices``): one read
    only by ops of checkpointed regions is not packed, as eager's checkpoint
    reads it again from the module and never packs it.

    >>> placement = place_saved_tensor_hooks(fw, bw, num_fwd_outputs=1,
    ...                                      hooks=GraphModuleHooks(pack_gm, unpack_gm))
    >>> placement.check(); [p.name for p in placement.packed]
    ['primals_1', 'relu']
    """
    if num_fwd_outputs is None:
        num_fwd_outputs = count_forward_outputs(forward, backward)
    layout = _read_layout(forward, backward, num_fwd_outputs)
    if isinstance(layout, Unsupported):
        return layout
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i] for i in static_input_indices if i < len(placeholders)}
    traced = _trace_saved(layout, hooks, scope, params)
    if isinstance(traced, Unsupported):
        return traced
    plans, kept = traced
    pack_effects = _pack_effects_in_eager_order(forward, plans)
    packed, lifted = _rewrite(forward, backward, layout, plans)
    unpack_effects = _unpack_effects_in_backward_order(backward, plans, packed)
    placement = Placement(
        forward,
        backward,
        num_fwd_outputs,
        tuple(packed),
        tuple(kept),
        pack_effects,
        unpack_effects,
        lifted,
    )
    placement.check()
    log.debug(
        "place_saved_tensor_hooks: packed %d saved tensor(s) with %s, kept %d",
        len(packed),
        hooks.description,
        len(kept),
    )
    return placement


def _read_layout(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int
) -> _SavedLayout | Unsupported:
    """The saved values, matched by position to the backward's leading placeholders.

    AOTAutograd hands the backward its saved sizes, then its saved tensors, in
    the forward's order, whatever the backward calls them; a renamed input
    must still agree in metadata (:func:`_mismatch`).
    """
    fw_out = forward.graph.output_node()
    outs: list[Any] = list(fw_out.args[0])  # type: ignore[arg-type]
    inner = outs[:num_fwd_outputs]
    saved = outs[num_fwd_outputs:]
    saved_tensors = [n for n in saved if isinstance(n, torch.fx.Node) and not is_sym_node(n)]
    saved_syms = [n for n in saved if is_sym_node(n)]
    bw_inputs = [n for n in backward.graph.nodes if n.op == "placeholder"]
    expected = saved_syms + saved_tensors
    got = bw_inputs[: len(expected)]
    why = None
    if saved != saved_tensors + saved_syms:
        why = "outputs other than nodes, or sizes before tensors"
    elif len(got) < len(expected):
        why = "it has fewer inputs"
    else:
        why = next((m for f, b in zip(expected, got, strict=True) if (m := _mismatch(f, b))), None)
    if why is not None:
        return Unsupported(
            HopsRefusalKind.UNEXPECTED_GRAPH_LAYOUT,
            f"graph {type(forward).__name__}",
            f"the forward saves {[n.name for n in expected]} but the backward starts with "
            f"{[n.name for n in got]} ({why})",
            "run the placement right after the partitioner, with its num_fwd_outputs",
        )
    return _SavedLayout(
        fw_out, inner, saved_tensors, saved_syms, dict(zip(expected, got, strict=True))
    )


def _trace_saved(
    layout: _SavedLayout, hooks: HookGraphs, scope: PackScope, params: set[torch.fx.Node]
) -> tuple[list[_Plan], list[tuple[str, str]]] | Unsupported:
    """Trace pack and unpack at each saved tensor in scope; the rest is kept, with why."""
    inner_set = {n for n in layout.inner if isinstance(n, torch.fx.Node)}
    plans: list[_Plan] = []
    kept: list[tuple[str, str]] = []
    for node in layout.saved_tensors:
        origin = _origin(node, inner_set)
        if scope is PackScope.ACTIVATIONS and origin is not SavedOrigin.ACTIVATION:
            kept.append((node.name, f"{origin.value} (pack scope is activations)"))
            continue
        if node in params and _only_in_checkpointed_regions(node):
            # NOTE: eager checkpointing saves a region's arguments, not what its ops
            # save; a parameter the region reads is read again from the module.
            kept.append((node.name, "parameter read only inside checkpointed regions"))
            continue
        if is_rng_state_output(node):
            # NOTE: eager checkpointing keeps the RNG state of a recomputed op in Python,
            # outside autograd: no hook sees it.
            kept.append((node.name, "RNG state of an op recomputed in backward"))
            continue
        if is_sdpa_philox_output(node):
            # NOTE: eager packs it, but its device is known only when the op runs (a
            # CPU scalar for memory-efficient attention outside a capture) and the
            # graph's example says the query's: a pack compiled for that device fails.
            # Kept unpacked: a few bytes, read only by the attention's backward.
            kept.append(
                (node.name, "attention's dropout seed or offset (device known at run time)")
            )
            continue
        if node.meta.get("saved_tensor_with_no_vc_check", False):
            kept.append((node.name, "saved without a version check by an autograd.Function"))
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            kept.append((node.name, "no example value"))
            continue
        traced = hooks.trace_pack(val)
        if isinstance(traced, Unsupported):
            return traced
        unpack = hooks.trace_unpack(traced, val)
        if isinstance(unpack, Unsupported):
            return unpack
        plans.append((node, traced, unpack))
    return plans, kept


def _only_in_checkpointed_regions(node: torch.fx.Node) -> bool:
    """Whether every forward op that reads ``node`` belongs to a checkpointed region."""
    users = [u for u in node.users if u.op != "output"]
    return bool(users) and all(in_checkpointed_region(u) for u in users)


def _pack_effects_in_eager_order(
    forward: torch.fx.GraphModule, plans: list[_Plan]
) -> tuple[HookEffects, ...]:
    """Pack side effects in the order eager packs: the op that first consumes each tensor."""
    fw_order = {n: i for i, n in enumerate(forward.graph.nodes)}

    def first_forward_use(item: _Plan) -> tuple[int, int]:
        # NOTE: eager saves a tensor at the op that consumes it, in argument order; a
        # view of it (the weight's transpose) is not that op: look through views.
        positions: list[tuple[int, int]] = []
        todo = [item[0]]
        while todo:
            node = todo.pop()
            for user in node.users:
                if user.op == "output":
                    continue
                if is_view_op(user.target):
                    todo.append(user)
                else:
                    positions.append((fw_order[user], user.all_input_nodes.index(node)))
        return min(positions, default=(fw_order[item[0]], 0))

    return tuple(
        t.effects for _, t, _ in sorted(plans, key=first_forward_use) if t.effects is not None
    )


class _LiftedInputs:
    """The forward inputs for the hooks' lifted values (one per key, after the
    forward's own inputs) and, for those an unpack reads, their saved copies in
    the backward (after the saved tensors, in the same order)."""

    def __init__(
        self,
        forward: torch.fx.GraphModule,
        backward: torch.fx.GraphModule,
        layout: _SavedLayout,
        taken: set[str],
    ) -> None:
        self.forward, self.backward, self.taken = forward, backward, taken
        self.inputs: dict[str, tuple[LiftedInput, torch.fx.Node]] = {}
        self.saved: dict[str, tuple[torch.fx.Node, torch.fx.Node]] = {}
        placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
        tensors = [layout.backward_inputs[n] for n in layout.saved_tensors]
        # NOTE: inserted after the last saved tensor's input, before it is replaced.
        self.bw_anchor = tensors[-1] if tensors else None
        self.bw_first = placeholders[len(layout.saved_syms)] if placeholders else None

    def forward_inputs(self, lifted: Sequence[LiftedInput]) -> list[torch.fx.Node]:
        nodes = []
        for value in lifted:
            if value.key not in self.inputs:
                graph = self.forward.graph
                last = [n for n in graph.nodes if n.op == "placeholder"][-1]
                with graph.inserting_after(last):
                    node = graph.placeholder(_unique(self.taken, "loom_lifted"))
                node.meta["val"] = value.example
                node.meta["loom_pass"] = "place_saved_tensor_hooks"
                self.inputs[value.key] = (value, node)
            nodes.append(self.inputs[value.key][1])
        return nodes

    def backward_inputs(self, lifted: Sequence[LiftedInput]) -> list[torch.fx.Node]:
        nodes = []
        for value, fw_node in zip(lifted, self.forward_inputs(lifted), strict=True):
            if value.key not in self.saved:
                graph = self.backward.graph
                where = (
                    graph.inserting_after(self.bw_anchor)
                    if self.bw_anchor is not None
                    else graph.inserting_before(self.bw_first)
                )
                with where:
                    node = graph.placeholder(fw_node.name)
                node.meta = dict(fw_node.meta)
                self.bw_anchor = node
                self.saved[value.key] = (fw_node, node)
            nodes.append(self.saved[value.key][1])
        return nodes

    @property
    def saved_outputs(self) -> list[torch.fx.Node]:
        return [fw_node for fw_node, _ in self.saved.values()]

    @property
    def values(self) -> tuple[LiftedInput, ...]:
        return tuple(value for value, _ in self.inputs.values())


def _rewrite(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    layout: _SavedLayout,
    plans: list[_Plan],
) -> tuple[list[PackedTensor], tuple[LiftedInput, ...]]:
    """Insert the pack and unpack calls and re-lay the saved outputs; what was packed,
    and the values the hooks read at each call (the forward's new last inputs)."""
    inner_set = {n for n in layout.inner if isinstance(n, torch.fx.Node)}
    taken = _names(forward.graph, backward.graph)
    replaced: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    packed: list[PackedTensor] = []
    sym_anchor: list[torch.fx.Node] = []
    lifted = _LiftedInputs(forward, backward, layout, taken)
    for node, traced, unpack in plans:
        anchor, leaves = _insert_pack(
            forward, node, traced, taken, lifted.forward_inputs(traced.lifted)
        )
        replaced[node] = leaves
        first_use = _insert_unpack(
            backward,
            layout.backward_inputs[node],
            unpack,
            leaves,
            sym_anchor,
            lifted.backward_inputs(unpack.lifted),
        )
        val = node.meta["val"]
        packed.append(
            PackedTensor(
                name=node.name,
                origin=_origin(node, inner_set),
                dtype=str(val.dtype),
                shape=tuple(str(s) for s in val.shape),
                device=str(val.device),
                crossing=tuple(leaf.name for leaf in leaves),
                pack_after=anchor.name,
                unpack_before=first_use.name if first_use is not None else "",
                crossing_devices=tuple(_device_of(leaf) for leaf in leaves),
            )
        )
    new_tensors: list[torch.fx.Node] = []
    new_syms: list[torch.fx.Node] = []
    for node in layout.saved_tensors:
        for leaf in replaced.get(node, [node]):
            (new_syms if is_sym_node(leaf) else new_tensors).append(leaf)
    new_tensors += lifted.saved_outputs
    layout.output.args = (tuple(layout.inner + new_tensors + new_syms + layout.saved_syms),)
    forward.graph.lint()  # type: ignore[no-untyped-call]
    backward.graph.lint()  # type: ignore[no-untyped-call]
    forward.recompile()
    backward.recompile()
    return packed, lifted.values


def _unpack_effects_in_backward_order(
    backward: torch.fx.GraphModule, plans: list[_Plan], packed: list[PackedTensor]
) -> tuple[HookEffects, ...]:
    """Unpack side effects in the order the rewritten backward runs the unpacks."""
    bw_order = {n: i for i, n in enumerate(backward.graph.nodes)}
    unpack_at = {p.name: bw_order.get(_node_named(backward, p.unpack_before), -1) for p in packed}
    return tuple(
        u.effects
        for _, _, u in sorted(plans, key=lambda item: unpack_at[item[0].name])
        if u.effects is not None
    )
