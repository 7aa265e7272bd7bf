"""Python saved-tensor hooks, traced by the hook tracer at each saved tensor.

:class:`TracedPythonHooks` is the :class:`HookGraphs` for a pair of plain
functions. The pack hook is traced once per saved tensor metadata (dtype,
shape, stride, device) with ``loom_tracer.trace_hook``; its graph and the
side-effect-free part of its replay plan (the return value) become the pack
graph, and its side effects become a replay step run after the compiled
forward, once per saved tensor, in order. The unpack hook is traced at the
packed value; its side effects run after the compiled backward. Hooks whose
side effects would need tensors or symbolic values at replay time, or that
read tensors from their closure or globals, are refused.
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
from loom_sidefx import ArgSource, Computed, Op, Original, Ref, ReplayPlan, TensorSlot
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


@dataclasses.dataclass(frozen=True)
class _Traced:
    hook: TracedHook
    where: str

    @property
    def pure(self) -> ReplayPlan:
        return dataclasses.replace(self.hook.replay, ops=())

    def call_pure(self, *args: Any) -> Any:
        """The hook's return value, computed by its graph, without its side effects."""
        outs = self.hook.graph(*self.hook.graph_inputs(*args))
        return self.pure.apply(self.hook.roots(*args), tuple(outs))[0]

    def effects(self, example_args: tuple[Any, ...], role: str) -> HookEffects | None:
        plan = self.hook.replay
        if not plan.ops:
            return None
        # NOTE: new objects the return value needs are rebuilt too; they read graph
        # outputs, which are the compile-time fake values here (never escaping).
        mode = fake_mode_of(list(pytree.tree_leaves(example_args)))
        with mode if mode is not None else contextlib.nullcontext():
            fake_outs = tuple(self.hook.graph(*self.hook.graph_inputs(*example_args)))
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
    outside = [s.describe() for s in traced.input_sources if not isinstance(s.root(), ArgSource)]
    if outside:
        return Unsupported(
            HopsRefusalKind.HOOK_READS_OUTSIDE_TENSORS,
            where,
            f"the hook reads tensors from {', '.join(outside)}",
            "pass such tensors through the packed value, or write the hook as a GraphModule",
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
    return _Traced(traced, where)


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
        self._guards: dict[tuple[str, str], tuple[TracedHook, tuple[Any, ...]]] = {}

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
            self._guards.setdefault((role, checked.hook.guard_source), (checked.hook, args))
        return checked

    def trace_pack(self, saved: torch.Tensor) -> TracedPack | Unsupported:
        key = _meta_key(saved)
        if key not in self._packs:
            self._packs[key] = self._trace("pack", (saved,))
        traced = self._packs[key]
        if isinstance(traced, Unsupported):
            return traced
        result = trace_pack_graph(
            traced.call_pure, saved, self.decompositions, where=self._named("pack")
        )
        if isinstance(result, Unsupported):
            return result
        return dataclasses.replace(
            result, effects=traced.effects((saved,), "pack"), fingerprint=traced.hook.fingerprint
        )

    def trace_unpack(self, pack: TracedPack, saved: torch.Tensor) -> TracedUnpack | Unsupported:
        packed = rebuild_packed(pack.layout, pack.example_outputs)
        traced = self._trace("unpack", (packed,))
        if isinstance(traced, Unsupported):
            return traced
        result = trace_unpack_graph(
            traced.call_pure, pack, saved, self.decompositions, where=self._named("unpack")
        )
        if isinstance(result, Unsupported):
            return result
        return dataclasses.replace(result, effects=traced.effects((packed,), "unpack"))

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
        for (role, _), (hook, args) in self._guards.items():
            roots = roots_of(_hook(active, role), args)
            if not hook.guard_fn(roots):
                failed = next((g.describe() for g in hook.guards if not g.check(roots)), "")
                return HookMismatch(role, HookDifference.TRACED_VALUE, failed or "guards fail")
            if role == "unpack" and hook.replay.ops:
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
        hooks = [hook for hook, _ in self._guards.values()]
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
