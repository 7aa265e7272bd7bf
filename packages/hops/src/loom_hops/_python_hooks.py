"""Python saved-tensor hooks, traced by the hook tracer at each saved tensor.

:class:`TracedPythonHooks` is the :class:`HookGraphs` for a pair of plain
functions. The pack hook is traced once per saved tensor metadata (dtype,
shape, stride, device) with ``loom_tracer.trace_hook``; its graph and the
side-effect-free part of its replay plan (the return value) become the pack
graph, and its side effects become a replay step run after the compiled
forward, once per saved tensor, in order. The unpack hook is traced at the
packed value; its side effects run after the compiled backward. What a hook
reads from outside its arguments into the graph (a float or int the tracer
lifted, a tensor of its closure or globals) becomes a graph input
(``LiftedInput``), read from the active pair at each call. Hooks whose side
effects would need tensors or symbolic values at replay time are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from loom_hops._hook_graphs import (
    HookEffects,
    LiftedInput,
    TracedPack,
    TracedUnpack,
    rebuild_packed,
    trace_pack_graph,
    trace_unpack_graph,
)
from loom_hops._hook_match import (
    HookDifference,
    HookMismatch,
    function_mismatch,
    roots_of,
    static_mismatch,
)
from loom_hops._hook_pair import HookPair
from loom_hops._torch_compat import fake_mode_of, pytree
from loom_hops._unsupported import HopsRefusalKind, Unsupported
from loom_sidefx import (
    ArgSource,
    Computed,
    Guard,
    GuardKind,
    Op,
    Original,
    Ref,
    ReplayPlan,
    Roots,
    TensorSlot,
    is_constant,
)
from loom_tracer import HookUnsupported, TracedHook, trace_hook

__all__ = ["TracedPythonHooks", "trace_python_hooks"]

Decompositions = Mapping[Any, Callable[..., Any]]


def _is_number_like(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        return False
    if isinstance(value, (tuple, list)):
        return all(_is_number_like(v) for v in value)
    return True


def _replayable(value: Any, plan: ReplayPlan) -> bool:
    """Whether ``value`` can be evaluated after the graph without graph outputs or arguments."""
    if isinstance(value, TensorSlot):
        return False  # the value lives in the graph
    if isinstance(value, Original):
        return value.source is not None and not isinstance(value.source.root(), ArgSource)
    if isinstance(value, Computed):
        return _replayable(value.lhs, plan) and _replayable(value.rhs, plan)
    if isinstance(value, tuple):
        return all(_replayable(v, plan) for v in value)
    if isinstance(value, Ref):
        for pre in plan.preexisting:
            if pre.ref == value:
                return not isinstance(pre.source.root(), ArgSource)
        new = next(n for n in plan.new_objects if n.ref == value)
        parts = (*new.items, *(v for _, v in new.entries), *(v for _, v in new.attrs))
        return all(_replayable(v, plan) for v in (*parts, *new.contents))
    return _is_number_like(value)


def _describe_op(op: Op, plan: ReplayPlan) -> str:
    target = "" if op.target is None else f" on {plan.names()[op.target]}"
    return f"{op.kind.value}{target}"


def _folded_numbers(value: Any, plan: ReplayPlan) -> list[Guard]:
    """Guards for the numbers read from the closure, globals or an object that the
    hook's return value carries (``return (t * s, s)``): the packed layout folds them
    into the unpack graph as constants, so they must keep their value."""
    if isinstance(value, Original):
        source = value.source
        if source is None or isinstance(source.root(), ArgSource) or not is_constant(value.obj):
            return []
        return [Guard(GuardKind.EQUALS, source, value.obj)]
    if isinstance(value, Computed):
        return _folded_numbers(value.lhs, plan) + _folded_numbers(value.rhs, plan)
    if isinstance(value, tuple):
        return [g for v in value for g in _folded_numbers(v, plan)]
    if isinstance(value, Ref):
        new = next((n for n in plan.new_objects if n.ref == value), None)
        if new is None:
            return []
        parts = (*new.items, *(v for _, v in new.entries), *(v for _, v in new.attrs))
        return [g for v in (*parts, *new.contents) for g in _folded_numbers(v, plan)]
    return []


@dataclasses.dataclass(frozen=True)
class _Traced:
    hook: TracedHook
    where: str
    #: Guards on numbers the return value carries as constants (:func:`_folded_numbers`).
    folded: tuple[Guard, ...] = ()

    def holds(self, roots: Roots) -> bool:
        """Whether this trace serves a call with ``roots``: its guards and the folded numbers."""
        return bool(self.hook.guard_fn(roots)) and all(g.check(roots) for g in self.folded)

    def failed_guard(self, roots: Roots) -> str:
        failed = (g for g in (*self.hook.guards, *self.folded) if not g.check(roots))
        return next((g.describe() for g in failed), "guards fail")

    @property
    def pure(self) -> ReplayPlan:
        return dataclasses.replace(self.hook.replay, ops=())

    def call_pure(self, *args: Any, outside: tuple[Any, ...] = ()) -> Any:
        """The hook's return value, computed by its graph, without its side effects;
        ``outside`` gives the values read from outside the arguments (graph inputs)."""
        outs = self.hook.graph(*self.hook.graph_inputs(*args, outside=outside))
        return self.pure.apply(self.hook.roots(*args), tuple(outs))[0]

    def lifted(self, role: str, example_args: tuple[Any, ...]) -> tuple[LiftedInput, ...]:
        """What the graph reads from outside the arguments, as graph inputs: examples
        in the fake mode of ``example_args``, values read from a pair's hook."""
        hook = self.hook
        mode = fake_mode_of(list(pytree.tree_leaves(example_args)))
        lifted: list[LiftedInput] = []
        for i in hook.outside_inputs:
            number = hook.input_numbers[i] if hook.input_numbers else None
            if number is not None:
                with mode if mode is not None else contextlib.nullcontext():
                    example = torch.empty((), dtype=number[0], device=number[1])
                what = f"number {number[0]} {number[1]}"
            else:
                real = hook.read_input(i, hook.roots(*example_args))
                example = real if mode is None else mode.from_tensor(real, static_shapes=True)
                what = f"tensor {real.dtype} {tuple(real.shape)} {real.device}"

            def read(pair: HookPair, i: int = i) -> torch.Tensor:
                return hook.read_input(i, roots_of(_hook(pair, role), ()))

            key = f"{role} {hook.input_sources[i].describe()} {what}"
            lifted.append(LiftedInput(key, example, read))
        return tuple(lifted)

    def effects(
        self, example_args: tuple[Any, ...], role: str, lifted: tuple[LiftedInput, ...] = ()
    ) -> HookEffects | None:
        plan = self.hook.replay
        if not plan.ops:
            return None
        # NOTE: new objects the return value needs are rebuilt too; they read graph
        # outputs, which are the compile-time fake values here (never escaping).
        mode = fake_mode_of(list(pytree.tree_leaves(example_args)))
        outside = tuple(x.example for x in lifted)
        with mode if mode is not None else contextlib.nullcontext():
            inputs = self.hook.graph_inputs(*example_args, outside=outside)
            fake_outs = tuple(self.hook.graph(*inputs))
        replay = dataclasses.replace(plan, results=())

        def run_effects(pair: HookPair) -> None:
            # NOTE: on the given pair's closure and globals: a content-equal pair made
            # for this call (save_on_cpu() makes new closures each time) gets its effects.
            replay.apply(roots_of(_hook(pair, role), example_args), fake_outs)

        return run_effects


def _check(traced: TracedHook | HookUnsupported, where: str) -> _Traced | Unsupported:
    if isinstance(traced, HookUnsupported):
        return Unsupported(
            HopsRefusalKind.HOOK_NOT_TRACEABLE,
            traced.where or where,
            f"the hook tracer refused it: {traced.kind.value}: {traced.explanation}",
            traced.hint,
        )
    plan = traced.replay
    for op in plan.ops:
        if not all(_replayable(v, plan) for v in (op.target, *op.args)):
            return Unsupported(
                HopsRefusalKind.HOOK_SIDE_EFFECTS_UNSUPPORTED,
                op.where or where,
                f"the side effect {_describe_op(op, plan)} needs a tensor or a symbolic value "
                "from the graph at replay time",
                "record Python values (sizes of static shapes, dtypes, counts) instead",
            )
    folded = dict.fromkeys(g for v in plan.results for g in _folded_numbers(v, plan))
    return _Traced(traced, where, tuple(folded))


def _meta_key(t: torch.Tensor) -> tuple[str, ...]:
    return (
        str(t.dtype),
        str(tuple(t.shape)),
        str(tuple(t.stride())),
        str(t.device),
        str(t.requires_grad),
    )


def _hook(pair: HookPair, role: str) -> Callable[..., Any]:
    return pair.pack if role == "pack" else pair.unpack


class TracedPythonHooks:
    """``(pack, unpack)`` plain functions, traced per saved tensor with the hook tracer.

    The traces serve any pair that runs the same code with the same defaults and
    on which every trace's guards hold (:meth:`mismatch`).
    """

    description = "traced Python hooks"

    def __init__(self, pair: HookPair, decompositions: Decompositions | None = None) -> None:
        self.pair = pair
        self.decompositions = decompositions
        self._packs: dict[tuple[str, ...], _Traced | Unsupported] = {}
        #: (role, guard source) -> one trace with those guards, and its example arguments.
        self._guards: dict[tuple[str, str], tuple[_Traced, tuple[Any, ...]]] = {}

    def _where(self, fn: Any) -> str:
        code = getattr(fn, "__code__", None)
        if code is None:
            return str(getattr(fn, "__qualname__", type(fn).__name__))
        return f"{code.co_filename}:{code.co_firstlineno}"

    def _named(self, role: str) -> str:
        """The user's hook as refusals name it (the graphs trace loom's wrapper of it)."""
        fn = _hook(self.pair, role)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return f"{role} hook {name} ({self._where(fn)})"

    def _trace(self, role: str, args: tuple[Any, ...]) -> _Traced | Unsupported:
        fn = _hook(self.pair, role)
        checked = _check(trace_hook(fn, args), self._where(fn))
        if isinstance(checked, _Traced):
            key = (role, checked.hook.guard_source + "".join(g.describe() for g in checked.folded))
            self._guards.setdefault(key, (checked, args))
        return checked

    def trace_pack(self, saved: torch.Tensor) -> TracedPack | Unsupported:
        key = _meta_key(saved)
        if key not in self._packs:
            self._packs[key] = self._trace("pack", (saved,))
        traced = self._packs[key]
        if isinstance(traced, Unsupported):
            return traced
        lifted = traced.lifted("pack", (saved,))

        def pack(x: torch.Tensor, *extra: torch.Tensor) -> Any:
            return traced.call_pure(x, outside=extra)

        result = trace_pack_graph(
            pack, saved, self.decompositions, where=self._named("pack"), lifted=lifted
        )
        if isinstance(result, Unsupported):
            return result
        effects = traced.effects((saved,), "pack", lifted)
        return dataclasses.replace(result, effects=effects, fingerprint=traced.hook.fingerprint)

    def trace_unpack(self, pack: TracedPack, saved: torch.Tensor) -> TracedUnpack | Unsupported:
        packed = rebuild_packed(pack.layout, pack.example_outputs)
        traced = self._trace("unpack", (packed,))
        if isinstance(traced, Unsupported):
            return traced
        lifted = traced.lifted("unpack", (packed,))

        def unpack(p: Any, *extra: torch.Tensor) -> Any:
            return traced.call_pure(p, outside=extra)

        where = self._named("unpack")
        result = trace_unpack_graph(
            unpack, pack, saved, self.decompositions, where=where, lifted=lifted
        )
        if isinstance(result, Unsupported):
            return result
        return dataclasses.replace(result, effects=traced.effects((packed,), "unpack", lifted))

    def mismatch(self, active: HookPair | None) -> HookMismatch | None:
        """Why the traces do not serve ``active``: other code or defaults, a guard of a
        trace failing on ``active``'s closure and globals, or an unpack with side effects
        whose closure differs. ``None``: the compiled graphs serve it."""
        if active is None or active.kind != "python":
            return static_mismatch(self.pair, active)
        for role in ("pack", "unpack"):
            found = function_mismatch(
                role, _hook(self.pair, role), _hook(active, role), closure_values=False
            )
            if found is not None:
                return found
        for (role, _), (traced, args) in self._guards.items():
            roots = roots_of(_hook(active, role), args)
            if not traced.holds(roots):
                failed = traced.failed_guard(roots)
                return HookMismatch(role, HookDifference.TRACED_VALUE, failed)
            if role == "unpack" and traced.hook.replay.ops:
                # NOTE: unpack effects replay on the compiled pair's state (the backward
                # cannot tell which forward's pair it serves): it must hold what `active` does.
                found = function_mismatch(
                    role, self.pair.unpack, active.unpack, closure_values=True
                )
                if found is not None:
                    return HookMismatch(
                        role,
                        HookDifference.EFFECT_TARGET,
                        f"its side effects replay on the compiled hook's closure: {found.detail}",
                    )
        return None

    def fingerprint(self) -> str | None:
        """Fingerprints of the traces made so far, combined; ``None`` if any is opaque."""
        hooks = [traced.hook for traced, _ in self._guards.values()]
        if any(h.opaque for h in hooks):
            return None
        h = hashlib.sha256(b"loom-python-hooks-v1;")
        for fp in sorted(hook.fingerprint for hook in hooks):
            h.update(fp.encode())
        return h.hexdigest()


def trace_python_hooks(
    pair: HookPair, decompositions: Decompositions | None = None
) -> TracedPythonHooks | Unsupported:
    """The :class:`PythonHookTracer` backed by ``loom_tracer``."""
    return TracedPythonHooks(pair, decompositions)
