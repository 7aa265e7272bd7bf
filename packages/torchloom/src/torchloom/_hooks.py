"""The hooks steps: saved-tensor hooks placed inside compiled graphs (``loom_hops``).

At compile time :func:`prepare_hooks` takes the innermost active
``saved_tensors_hooks`` pair and guards the Dynamo frame on its *content* (a
pair made anew with the same code and the same values its traces read, such as
each ``save_on_cpu()``, reuses the compilation; a call under other hooks
recompiles). Each frame compiles at most ``saved_tensor_hooks_variants`` pairs
distinct by content, each recorded in the report with how it differs from the
pairs seen; one more compilation runs every further pair's hooks eagerly.
After the partitioner :func:`place_hooks` packs every saved tensor right after
its last forward use and unpacks it right before its first backward use, as
``loom_saved_tensor_pack``/``unpack`` nodes that stay visible in the report and
are inlined just before codegen. At run time (:func:`wrap_hooks_runtime`) the compiled callable runs with
eager application of the hooks disabled, so nothing is packed twice. Hooks it
cannot trace stay eager (PyTorch's behaviour), with the reason in the report,
or raise in strict mode. When a pack moves tensors to another device (CPU
offload), both graphs are generated in the order the placement made: Inductor's
peak-memory reordering counts host buffers as device memory and would hoist
every copy back to the device to the start of the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule

import loom_hops
from torchloom import _torch_compat as compat
from torchloom._errors import LoomRefusal, RefusalKind, Unsupported
from torchloom._offload import lower_offload_step, register_offload_operators
from torchloom._report import GraphRecordBuilder
from torchloom._values import Codegen, GraphKind, Snapshot

__all__ = [
    "FrameVariants",
    "HookPlacement",
    "HookVariantDecision",
    "HooksPlan",
    "hooks_compile_context",
    "inline_hook_graphs",
    "order_tensor_hooks",
    "place_hooks",
    "place_saved_tensor_hooks",
    "prepare_hooks",
    "with_saved_strides",
    "wrap_hooks_runtime",
]

log = logging.getLogger("torchloom.hooks")


if TYPE_CHECKING:
    #: A compiled pair and the hook graphs its guard matches others with (None: by content alone).
    Variant = tuple[loom_hops.HookPair | None, loom_hops.HookGraphs | None]


@dataclasses.dataclass
class FrameVariants:
    """The saved-tensor hook pairs compiled for one Dynamo frame (code object), in order,
    each with the number of its content class (1, 2, ...): a pair compiled again for
    another reason (shapes, grad mode) joins the class of the pair it equals."""

    entries: list[tuple[Variant, int]] = dataclasses.field(default_factory=list)

    @property
    def compiled(self) -> list[Variant]:
        return [variant for variant, _ in self.entries]

    @property
    def distinct(self) -> int:
        return max((c for (pair, _), c in self.entries if pair is not None), default=0)

    def add(self, variant: Variant, content_class: int) -> None:
        self.entries.append((variant, content_class))


_frames: weakref.WeakKeyDictionary[types.CodeType, FrameVariants] = weakref.WeakKeyDictionary()


def frame_variants() -> FrameVariants:
    """The variants of the frame Dynamo is compiling (fresh outside Dynamo, and for a
    frame Dynamo holds no compiled entry of, e.g. after a Dynamo reset)."""
    frame = compat.dynamo_frame_code()
    if frame is None:
        return FrameVariants()
    code, entries = frame
    if entries == 0 or code not in _frames:
        _frames[code] = FrameVariants()
    return _frames[code]


@dataclasses.dataclass(frozen=True, slots=True)
class HookVariantDecision:
    """How this compilation relates to the pairs its frame compiled before."""

    #: The content class the active pair joins (1, 2, ...); 0 for no hooks.
    content_class: int
    #: True: a new distinct pair past the bound, whose hooks stay eager.
    past_limit: bool
    #: Why each earlier pair (by content class) does not serve the active one.
    differences: tuple[tuple[int, loom_hops.HookMismatch], ...]
    #: The earlier content class the active pair matches, if any.
    same_as: int | None


def decide_variant(
    frame: FrameVariants, pair: loom_hops.HookPair | None, limit: int
) -> HookVariantDecision:
    """Match ``pair`` against the frame's compiled pairs (by content, not identity)."""
    differences: dict[int, loom_hops.HookMismatch] = {}
    for (compiled, graphs), content_class in frame.entries:
        if compiled is None:
            continue
        found = loom_hops.pair_mismatch(compiled, pair, graphs)
        if found is None:
            return HookVariantDecision(content_class, False, (), content_class)
        differences.setdefault(content_class, found)
    if pair is None:
        return HookVariantDecision(0, False, tuple(differences.items()), None)
    past = frame.distinct >= max(limit, 1)
    return HookVariantDecision(frame.distinct + 1, past, tuple(differences.items()), None)


def _describe(decision: HookVariantDecision, limit: int) -> str:
    if decision.same_as is not None:
        return (
            f"saved-tensor hooks equal by content to pair #{decision.same_as} of this frame: "
            "compiled again for another reason (shapes, grad mode or other guards)"
        )
    seen = "; ".join(f"#{c} {m}" for c, m in decision.differences)
    if decision.content_class == 0:
        return f"no saved-tensor hooks active, unlike the pairs seen: {seen}"
    if decision.past_limit:
        return (
            f"new saved-tensor hook pair past the limit of {limit} per frame "
            f"(saved_tensor_hooks_variants): this compilation runs its hooks eagerly and "
            f"serves every further pair; differs from the pairs seen: {seen}"
        )
    if not seen:
        return f"saved-tensor hook pair #{decision.content_class} of this frame (the first)"
    first = decision.differences[0][1].difference.value
    return (
        f"new saved-tensor hook pair #{decision.content_class} of at most {limit} for this "
        f"frame: {first} differs from the pairs seen: {seen}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class HooksPlan:
    """What :func:`prepare_hooks` decided about the active saved-tensor hooks.

    ``graphs`` holds the traced hook graphs when the hooks go into the compiled
    graphs; ``None`` leaves them eager (no pair, the option off, a refusal, or a
    pair past the frame's variant limit). ``fingerprint`` is the pair's content
    hash for the cache key (``None``: bypass the cache).
    """

    pair: loom_hops.HookPair | None
    fingerprint: str | None
    decision: HookVariantDecision
    #: The registry of the Dynamo frame being compiled (the pairs it compiled so far).
    frame: FrameVariants = dataclasses.field(compare=False)
    #: The pairs the frame compiled before; the past-limit compilation guards on them.
    others: tuple[Variant, ...] = ()
    graphs: loom_hops.HookGraphs | None = None
    refused: loom_hops.Unsupported | None = None

    @property
    def past_limit(self) -> bool:
        return self.decision.past_limit

    @property
    def in_graph(self) -> bool:
        return self.graphs is not None


@dataclasses.dataclass(frozen=True, slots=True)
class HookPlacement:
    """What :func:`place_hooks` did with the partitioned graphs: the placement, or
    the refusal that left the hooks eager."""

    placement: loom_hops.Placement | None = None
    refused: loom_hops.Unsupported | None = None


def _refuse(snapshot: Snapshot, reason: loom_hops.Unsupported) -> loom_hops.Unsupported:
    snapshot.record.add_entry(
        "hooks",
        "refused",
        f"saved_tensors_hooks stay eager: {reason}",
        kind_=reason.kind.value,
        refusal=reason,
    )
    if snapshot.options.strict:
        raise LoomRefusal(
            Unsupported(
                RefusalKind.STAGE_REFUSED,
                reason.where,
                f"loom_hops: {reason}",
                reason.hint,
                cause=reason,
            )
        )
    log.warning("graph %d: saved_tensors_hooks stay eager: %s", snapshot.graph_id, reason)
    return reason


def prepare_hooks(snapshot: Snapshot) -> HooksPlan:
    """Decide how the active saved-tensor hooks compile, and trace them if they go
    into the graphs: match the pair against the frame's variants, record how it
    differs, and trace it (refusals stay eager, or raise in strict mode)."""
    options, pair = snapshot.options, snapshot.hook_pair
    frame = frame_variants()
    limit = options.saved_tensor_hooks_variants
    decision = decide_variant(frame, pair, limit)
    plan = HooksPlan(pair, loom_hops.fingerprint_hooks(pair), decision, frame)
    if pair is not None or decision.differences:
        snapshot.record.add_entry(
            "hooks",
            "eager" if decision.past_limit else "variant",
            _describe(decision, limit),
            variant=decision.content_class,
            differences=tuple(f"#{c} {m}" for c, m in decision.differences),
        )
    if decision.past_limit:
        return dataclasses.replace(plan, others=tuple(frame.compiled))
    if pair is not None and options.saved_tensor_hooks_in_graph:
        register_offload_operators()
    if pair is None or not options.saved_tensor_hooks_in_graph:
        if pair is not None:
            snapshot.record.add_entry("hooks", "eager", "saved_tensor_hooks_in_graph is off")
        return plan
    # NOTE: hook graphs join graphs AOTAutograd traced with these decompositions.
    decompositions = compat.inductor_decompositions() if options.codegen == "inductor" else None
    graphs = loom_hops.prepare_saved_tensors_hooks(pair, decompositions=decompositions)
    if isinstance(graphs, loom_hops.Unsupported):
        return dataclasses.replace(plan, refused=_refuse(snapshot, graphs))
    return dataclasses.replace(plan, graphs=graphs)


def hooks_compile_context(plan: HooksPlan) -> contextlib.AbstractContextManager[None]:
    """Around the compile (cold or served): Dynamo's own inlining of the pair is off
    when loom places it, or when the pair is past the limit and runs eagerly."""
    if plan.past_limit or plan.in_graph:
        return loom_hops.native_hook_inlining_disabled(plan.pair)
    return contextlib.nullcontext()


def order_tensor_hooks(record: GraphRecordBuilder, gm: GraphModule) -> GraphModule:
    """Dynamo's graph: several ``register_hook`` hooks on one tensor in eager order."""
    result = loom_hops.order_intermediate_hooks(gm)
    if result.modified:
        record.add_entry(
            "hooks", "tensor_hooks", "several register_hook hooks on one tensor put in eager order"
        )
    return result.graph_module


def place_hooks(
    snapshot: Snapshot,
    plan: HooksPlan,
    fw_gm: GraphModule,
    bw_gm: GraphModule,
    place: Callable[..., loom_hops.Placement | loom_hops.Unsupported],
    *,
    num_fwd_outputs: int | None = None,
    static_input_indices: Sequence[int] = (),
) -> HookPlacement:
    """After the partitioner: pack each saved tensor after its last forward use and
    unpack it before its first backward use (``place`` is
    ``loom_hops.place_saved_tensor_hooks`` unless a test passes another;
    ``num_fwd_outputs`` and ``static_input_indices`` are what AOTAutograd told the
    partition step)."""
    if plan.graphs is None:
        return HookPlacement()
    record = snapshot.record
    scope = loom_hops.PackScope(snapshot.options.saved_tensor_hooks_scope)
    placement = place(
        fw_gm,
        bw_gm,
        num_fwd_outputs=num_fwd_outputs,
        hooks=plan.graphs,
        scope=scope,
        static_input_indices=static_input_indices,
    )
    if isinstance(placement, loom_hops.Unsupported):
        return HookPlacement(refused=_refuse(snapshot, placement))
    record.add_plan("hooks.placement", placement)
    packed = ", ".join(f"{p.name} after {p.pack_after}" for p in placement.packed)
    record.add_entry(
        "hooks",
        "placed",
        f"{len(placement.packed)} saved tensor(s) packed with {plan.graphs.description} "
        f"(scope {scope.value}): {packed or 'none'}",
        packed=tuple(p.name for p in placement.packed),
        kept=placement.kept,
        fingerprint=plan.fingerprint,
    )
    lower_offload_step(snapshot, placement, fw_gm, bw_gm)  # the report keeps its plan
    if placement.moved:
        record.add_entry(
            "hooks",
            "graph_order",
            f"{len(placement.moved)} packed tensor(s) live on another device: forward and "
            "backward keep the placement's order (Inductor's reorder_for_peak_memory off)",
            moved=placement.moved,
        )
    for kind, gm in (("forward+hooks", fw_gm), ("backward+hooks", bw_gm)):
        code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        record.add_graph(kind, code)
        log.debug("graph %d, %s:\n%s", snapshot.graph_id, kind, code)
    return HookPlacement(placement)


def place_saved_tensor_hooks(
    *args: Any, **kwargs: Any
) -> loom_hops.Placement | loom_hops.Unsupported:
    """:func:`loom_hops.place_saved_tensor_hooks`, the pipeline's placement: the pass
    (and the operators it places) is imported at the first graph with hooks to place."""
    return loom_hops.place_saved_tensor_hooks(*args, **kwargs)


def inline_hook_graphs(gm: GraphModule) -> GraphModule:
    """Before codegen: the pack/unpack subgraph HOPs inlined into the aten graph."""
    return loom_hops.inline_subgraph_hops(gm).graph_module


def in_placement_order(
    codegen: Codegen, placed: HookPlacement, kind: GraphKind, graph_id: int
) -> Codegen:
    """``codegen`` with Inductor's peak-memory reordering off when packed values
    live on another device (CPU offload)."""
    placement = placed.placement
    if placement is None or not placement.moved or kind is GraphKind.INFERENCE:
        return codegen
    # NOTE: Inductor's memory model (torch 2.11, _inductor/memory.py) sums buffers of
    # every device: a copy from a host input frees as much as it allocates, so its
    # peak-memory reordering moves the unpacks' copies to the start of the backward
    # (and may move the pack copies late in the forward). The placement already put
    # each at its last/first use: keep that order (for CUDA-graph segments too).
    log.debug(
        "graph %d, %s: %d offloaded tensor(s), codegen in placement order",
        graph_id,
        kind.value,
        len(placement.moved),
    )

    def codegen_in_placement_order(
        g: GraphModule, inputs: Sequence[Any], static: Sequence[int]
    ) -> Callable[..., Any]:
        with compat.inductor_config.patch(reorder_for_peak_memory=False):
            return codegen(g, inputs, static)

    return codegen_in_placement_order


def with_unpack_effects(
    fn: Callable[..., Any], plan: HooksPlan, placed: HookPlacement, kind: GraphKind
) -> Callable[..., Any]:
    """A compiled backward that replays the unpack hooks' side effects after it runs."""
    placement = placed.placement
    if kind is not GraphKind.BACKWARD or placement is None or not placement.unpack_effects:
        return fn
    effects, compiled_pair = placement.unpack_effects, plan.pair
    assert compiled_pair is not None

    def backward_then_unpack_effects(*args: Any) -> Any:
        out = fn(*args)
        for replay in effects:
            replay(compiled_pair)
        return out

    return compat.mark_boxed(backward_then_unpack_effects)


def with_saved_strides(
    fn: Callable[..., Any],
    plan: HooksPlan,
    placed: HookPlacement,
    kind: GraphKind,
    g: GraphModule,
    inputs: Sequence[Any],
) -> Callable[..., Any]:
    """A compiled backward whose saved tensors come back from hooks that run eagerly
    (refused, past the variant limit, or the option off) with the strides it was
    compiled for.

    An eager unpack may return other strides than the saved tensor had
    (``save_on_cpu()`` packs into ``torch.empty(t.size())``: SDPA's transposed q, k
    and v come back contiguous); eager autograd formulas accept any strides, the
    generated backward asserts them. Each saved tensor whose strides differ is
    copied to the expected ones before the call (nothing is copied when they match).
    """
    eager_hooks = plan.pair is not None and (plan.graphs is None or placed.refused is not None)
    if kind is not GraphKind.BACKWARD or not eager_hooks:
        return fn
    names = [n.name for n in g.graph.nodes if n.op == "placeholder"]
    expected: list[tuple[int, tuple[int, ...]]] = []
    for i, (name, value) in enumerate(zip(names, inputs, strict=False)):
        if name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        stride = tuple(value.stride())
        if all(isinstance(s, int) for s in stride):
            expected.append((i, stride))
    if not expected:
        return fn

    def backward_with_saved_strides(args: list[Any]) -> Any:
        for i, stride in expected:
            arg = args[i]
            if isinstance(arg, torch.Tensor) and arg.stride() != stride:
                fixed = torch.empty_strided(arg.shape, stride, dtype=arg.dtype, device=arg.device)
                args[i] = fixed.copy_(arg)
        return fn(args)

    return compat.mark_boxed(backward_with_saved_strides)


#: The values the hooks read at this call (``Placement.lifted``), for the compiled
#: forward: set around the call by :func:`wrap_hooks_runtime`.
_HOOK_VALUES: contextvars.ContextVar[tuple[torch.Tensor, ...]] = contextvars.ContextVar(
    "loom_hook_values", default=()
)


def lifted_hook_inputs(placed: HookPlacement, kind: GraphKind) -> tuple[Any, ...]:
    """Example values of the inputs the placement added to the forward (none elsewhere)."""
    placement = placed.placement
    if kind is not GraphKind.FORWARD or placement is None:
        return ()
    return tuple(value.example for value in placement.lifted)


def with_hook_values(fn: Callable[..., Any], placed: HookPlacement, kind: GraphKind) -> Any:
    """A compiled forward that takes AOTAutograd's arguments and appends the values the
    hooks read at this call (a per-step scale), its last inputs."""
    count = len(lifted_hook_inputs(placed, kind))
    if count == 0:
        return fn
    boxed = bool(getattr(fn, "_boxed_call", False))

    def forward_with_hook_values(args: list[Any]) -> Any:
        values = _HOOK_VALUES.get()
        if len(values) != count:
            raise RuntimeError(
                f"loom: the compiled forward expects {count} hook value(s), got {len(values)}: "
                "it must run inside the frame's compiled callable"
            )
        full = [*args, *values]
        args.clear()  # the boxed convention: the callee owns (and frees) its inputs
        return fn(full) if boxed else fn(*full)

    return compat.mark_boxed(forward_with_hook_values)


def wrap_hooks_runtime(
    fn: Callable[..., Any], plan: HooksPlan, placed: HookPlacement
) -> Callable[..., Any]:
    """Guard the frame on the hooks (by content) and register the compiled pair with
    the frame; with the hooks in the graph, run with eager application of the hooks
    disabled and replay the pack hooks' side effects after each call."""
    if plan.past_limit:
        loom_hops.install_other_hooks_guard(list(plan.others))
        return fn
    if plan.graphs is None:
        loom_hops.install_hooks_guard(plan.pair)
        plan.frame.add((plan.pair, None), plan.decision.content_class)
        return fn
    # NOTE: after compiling, so that the tracer's guards (made while placing) are included.
    loom_hops.install_hooks_guard(plan.pair, plan.graphs)
    plan.frame.add((plan.pair, plan.graphs), plan.decision.content_class)
    if placed.refused is not None:
        return fn
    pair, placement = plan.pair, placed.placement
    assert pair is not None
    lifted = placement.lifted if placement is not None else ()

    def run_with_hooks_in_graph(*args: Any) -> Any:
        # NOTE: the guard let in a pair equal by content: its state gets the effects,
        # and its closure gives the values the hooks read (a per-step scale).
        active = loom_hops.active_saved_tensors_hooks() or pair
        # NOTE: hooks that read no per-call value (most) skip the context variable.
        token = _HOOK_VALUES.set(tuple(value.read(active) for value in lifted)) if lifted else None
        try:
            with loom_hops.eager_saved_tensors_hooks_disabled():
                out = fn(*args)
        finally:
            if token is not None:
                _HOOK_VALUES.reset(token)
        if placement is not None and placement.pack_effects and torch.is_grad_enabled():
            for replay in placement.pack_effects:
                replay(active)
        return out

    return run_with_hooks_in_graph
