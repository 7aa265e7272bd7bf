"""What a whole-step CUDA graph depends on, as one frozen value per call.

A replay of a captured step is correct only while everything the capture read
from Python is unchanged: the arguments' shapes, dtypes and devices (and every
non-tensor argument's value), grad mode and autocast, the modules' parameters,
buffers and submodules (identity and address), the optimizers' parameter groups,
state tensors and hyperparameters, and whether each parameter's gradient exists.
:class:`StepProbe` reads all of it as a :class:`StepGuard`; a recording keeps the
guard of its capture and replays only when :meth:`StepGuard.mismatch` of the
current one is ``None``. Identity is ``id()``: the recording holds every object
it guards, so an id cannot be reused while the guard lives. Per call, a
:class:`FastCheck` (precomputed from a call whose guard held) answers the same
question at C speed; only when it fails is the guard read again.

Which modules and optimizers a step uses is found once
(:func:`~loom_step._targets.find_targets`); the per-call check lives in
:mod:`loom_step._fast`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from loom_step import _torch_compat as compat
from loom_step._fast import (
    END,
    MUTABLE,
    NEVER,
    REQUIRES_GRAD,
    FastCheck,
    args_check,
    fast_values,
    scalers_enabled,
    snapshot,
    unique_tensors,
)
from loom_step._targets import StepTargets

__all__ = [
    "ANY_TENSOR",
    "NEVER",
    "GuardKind",
    "GuardMismatch",
    "StepGuard",
    "StepProbe",
    "TensorSpec",
    "mode_state",
]

#: A gradient expectation: the step replaces this gradient, so any tensor may be there.
ANY_TENSOR = "any tensor"


class GuardKind(enum.Enum):
    """Which part of what a replay depends on changed (docs/capture_step.md)."""

    ARGUMENTS = "arguments"
    MODES = "modes"
    OBJECTS = "objects"
    ADDRESSES = "addresses"
    REQUIRES_GRAD = "requires_grad"
    HYPERPARAMETERS = "hyperparameters"
    GRADIENTS = "gradients"


@dataclasses.dataclass(frozen=True, slots=True)
class GuardMismatch:
    """Why a recording cannot replay this call: the kind and what changed."""

    kind: GuardKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor argument as a replay sees it: copied into a buffer of this shape."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def __str__(self) -> str:
        grad = " requires_grad" if self.requires_grad else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)} on {self.device}{grad}"


def mode_state() -> tuple[Any, ...]:
    """Grad mode and the autocast state a step is called under."""
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


_MODE_NAMES = (
    "grad mode",
    "CUDA autocast",
    "CUDA autocast dtype",
    "CPU autocast",
    "CPU autocast dtype",
    "autocast cache",
)


@dataclasses.dataclass(frozen=True, slots=True)
class StepGuard:
    """Everything a replay depends on, read at one call.

    ``objects``, ``pointers``, ``requires_grad`` and ``hyper`` come from the
    step's modules and optimizers (``requires_grad``: of the modules' and the
    step's own tensors, not of optimizer state); ``names`` says what each object is (for
    messages; not compared). ``grads`` holds, per parameter, ``None`` or the
    gradient's ``(id, address)`` (a DTensor's address: its local tensor's); a
    recording's guard may hold :data:`ANY_TENSOR` where the step replaces the
    gradient it finds.
    """

    tree: Any
    args: tuple[Any, ...]
    modes: tuple[Any, ...]
    objects: tuple[int, ...]
    pointers: tuple[int, ...]
    requires_grad: tuple[bool, ...]
    hyper: tuple[Any, ...]
    grads: tuple[Any, ...]
    names: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    tensor_names: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    hyper_names: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    param_names: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def mismatch(self, current: StepGuard, *, ignore_grads: bool = False) -> GuardMismatch | None:
        """``None`` when a recording made under ``self`` may replay ``current``,
        else the first difference (checked in the order of the fields)."""
        if self.tree != current.tree or self.args != current.args:
            return GuardMismatch(GuardKind.ARGUMENTS, self._args_diff(current))
        if self.modes != current.modes:
            i = _first_diff(self.modes, current.modes)
            return GuardMismatch(
                GuardKind.MODES,
                f"{_MODE_NAMES[i]} was {self.modes[i]} at capture, is {current.modes[i]} now",
            )
        if self.objects != current.objects:
            i = _first_diff(self.objects, current.objects)
            what = self.names[i] if i < len(self.names) else f"tracked object #{i}"
            return GuardMismatch(GuardKind.OBJECTS, f"{what} was replaced or the set changed")
        if self.pointers != current.pointers:
            i = _first_diff(self.pointers, current.pointers)
            what = self.tensor_names[i] if i < len(self.tensor_names) else f"tensor #{i}"
            return GuardMismatch(GuardKind.ADDRESSES, f"{what} moved to another address")
        if self.requires_grad != current.requires_grad:
            i = _first_diff(self.requires_grad, current.requires_grad)
            what = self.tensor_names[i] if i < len(self.tensor_names) else f"tensor #{i}"
            return GuardMismatch(
                GuardKind.REQUIRES_GRAD, f"{what}.requires_grad is {current.requires_grad[i]}"
            )
        if self.hyper != current.hyper:
            i = _first_diff(self.hyper, current.hyper)
            what = self.hyper_names[i] if i < len(self.hyper_names) else f"hyperparameter #{i}"
            return GuardMismatch(
                GuardKind.HYPERPARAMETERS,
                f"{what} was {self.hyper[i]!r} at capture, is {current.hyper[i]!r} now",
            )
        if not ignore_grads:
            for i, (want, got) in enumerate(zip(self.grads, current.grads, strict=True)):
                if want == got or (want == ANY_TENSOR and got is not None):
                    continue
                what = self.param_names[i] if i < len(self.param_names) else f"parameter #{i}"
                state = "None" if got is None else "another tensor"
                return GuardMismatch(GuardKind.GRADIENTS, f"{what}.grad is {state} now")
        return None

    def _args_diff(self, current: StepGuard) -> str:
        if self.tree != current.tree or len(self.args) != len(current.args):
            return "the arguments' structure changed"
        i = _first_diff(self.args, current.args)
        return f"argument leaf {i} was {self.args[i]} at capture, is {current.args[i]} now"


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if type(x) is not type(y) or x != y:
            return i
    return min(len(a), len(b))


def _leaf_spec(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return TensorSpec.of(v)
    return (type(v).__name__, v)


#: A name for messages, made only when the read keeps names.
Name = Callable[[], str]

_GRAD = operator.attrgetter("grad")
_OPT_CONTAINERS = operator.attrgetter("param_groups", "state")


@dataclasses.dataclass(slots=True)
class _GuardParts:
    """What one guard read collects, in the guard's order; :meth:`build` ends it.

    Objects are guarded by identity, tensors by identity and address (the first
    ``flagged`` of them by ``requires_grad`` too), hyperparameters by value. Each
    part comes with its :data:`Name`, called only when the read is ``named``.
    """

    named: bool
    objects: list[Any] = dataclasses.field(default_factory=list)
    names: list[str] = dataclasses.field(default_factory=list)
    tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    tensor_names: list[str] = dataclasses.field(default_factory=list)
    hyper: list[Any] = dataclasses.field(default_factory=list)
    hyper_names: list[str] = dataclasses.field(default_factory=list)
    #: how many of ``tensors`` have their ``requires_grad`` guarded
    flagged: int = 0

    def add_object(self, obj: Any, name: Name) -> None:
        self.objects.append(obj)
        if self.named:
            self.names.append(name())

    def add_tensor(self, t: torch.Tensor, name: Name) -> None:
        self.objects.append(t)
        self.tensors.append(t)
        if self.named:
            text = name()
            self.names.append(text)
            self.tensor_names.append(text)

    def add_hyper(self, value: Any, name: Name) -> None:
        self.hyper.append(value)
        if self.named:
            self.hyper_names.append(name())

    def add_value(self, value: Any, name: Name) -> None:
        """A hyperparameter or state value: tensors are guarded by identity and address
        (a replay reads their current value), anything else by value."""
        if isinstance(value, torch.Tensor):
            self.add_tensor(value, name)
        elif isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value):
            for k, v in enumerate(value):
                self.add_value(v, lambda k=k: f"{name()}[{k}]")  # type: ignore[misc]
        else:
            # A mutable value (a list of floats) is kept as a copy: the live one, changed in
            # place, would still compare equal to itself.
            self.add_hyper(snapshot(value) if isinstance(value, MUTABLE) else value, name)

    def build(
        self, leaves: Sequence[Any], tree: Any, params: Sequence[torch.Tensor], param_names: Any
    ) -> StepGuard:
        grads = tuple(None if (g := p.grad) is None else (id(g), compat.address(g)) for p in params)
        return StepGuard(
            tree=tree,
            args=tuple(_leaf_spec(v) for v in leaves),
            modes=mode_state(),
            objects=tuple(map(id, self.objects)),
            pointers=tuple(map(compat.address, self.tensors)),
            requires_grad=tuple(t.requires_grad for t in self.tensors[: self.flagged]),
            hyper=tuple(self.hyper),
            grads=grads,
            names=tuple(self.names),
            tensor_names=tuple(self.tensor_names),
            hyper_names=tuple(self.hyper_names),
            param_names=param_names if self.named else (),
        )


class StepProbe:
    """Reads a :class:`StepGuard` from the targets; built once per recording (the
    containers it reads are fixed then; a changed module tree shows as changed ids).
    """

    def __init__(self, targets: StepTargets) -> None:
        self.targets = targets
        self.params = targets.params()
        names: list[str] = []
        tensor_names: list[str] = []
        # (dict, is_tensor_dict) of every module: submodules, parameters, buffers.
        self._dicts: list[tuple[dict[str, Any], bool]] = []
        for base, module in targets.modules:
            for prefix, m in module.named_modules(prefix=base):
                for attr, is_tensor in (
                    ("_modules", False),
                    ("_parameters", True),
                    ("_buffers", True),
                ):
                    d = vars(m)[attr]
                    self._dicts.append((d, is_tensor))
                    for k, v in d.items():
                        if v is None:
                            continue
                        names.append(f"{prefix}.{k}")
                        if is_tensor:
                            tensor_names.append(f"{prefix}.{k}")
        self._names = tuple(names)
        self._tensor_names = tuple(tensor_names)
        pnames = {id(p): n for n, p in zip(tensor_names, self._module_tensors(), strict=False)}
        self._param_names = tuple(
            pnames.get(id(p), f"parameter #{i}") for i, p in enumerate(self.params)
        )

    def fast_check(
        self, args: Sequence[Any], grads: Sequence[Any], keywords: tuple[str, ...] = ()
    ) -> FastCheck:
        """The :class:`FastCheck` of the state now, for flat arguments ``args`` (the
        positional ones, then the values of the keyword ones named ``keywords``), with
        ``grads`` (one per parameter: a tensor, ``None`` or :data:`NEVER`) as the
        gradients the next call must find. Call it only where the full guard holds."""
        # An empty module dict (a leaf's submodules, most buffers) costs a length, not a view.
        views: list[Iterable[Any]] = [d.values() for d, _ in self._dicts if d]
        empty = [d for d, _ in self._dicts if not d]
        values: list[Any] = []
        inner: list[torch.Tensor] = []
        opts = tuple(opt for _, opt in self.targets.optimizers)
        for opt in opts:
            views += [opt.param_groups, opt.state.keys(), opt.state.values()]
            for group in opt.param_groups:
                views += [group.values(), group["params"]]
                fast_values((v for k, v in group.items() if k != "params"), views, values, inner)
            for state in opt.state.values():
                views.append(state.values())
                fast_values(state.values(), views, values, inner)
        reads = tuple(read for _, read in self.targets.roots)
        params = tuple(self.params)
        end = (END,)

        def stream() -> Iterator[Any]:
            return itertools.chain(
                itertools.chain.from_iterable(views),
                map(operator.call, reads),
                itertools.chain.from_iterable(map(_OPT_CONTAINERS, opts)),
                map(_GRAD, params),
                end,
            )

        now = list(stream())
        held = [*now[: len(now) - len(params) - 1], *grads, END]
        flagged = unique_tensors([*self._module_tensors(), *(t for _, t in self.targets.tensors)])
        tensors = unique_tensors([*now[: len(now) - len(params) - 1], *inner, *flagged, *grads])
        scalers = tuple(s for _, s in self.targets.scalers)
        # A DTensor's own data_ptr() is 0: its local tensor's identity and address instead.
        pairs = [(t, compat.local_tensor(t)) for t in tensors]
        wrapped = [(t, inner) for t, inner in pairs if inner is not None]
        memory = unique_tensors(
            [*(t for t, inner in pairs if inner is None), *(i for _, i in wrapped)]
        )
        return FastCheck(
            nargs=len(args),
            args_match=args_check(args),
            keywords=keywords,
            global_state=compat.global_state_check(mode_state),
            autocast_dtypes=(torch.get_autocast_dtype("cuda"), torch.get_autocast_dtype("cpu")),
            stream=stream,
            held=held,
            tensors=memory,
            pointers=[t.data_ptr() for t in memory],
            indices=list(range(len(memory))),
            wrapped=[t for t, _ in wrapped],
            locals=[inner for _, inner in wrapped],
            flagged=flagged,
            requires_grad=list(map(REQUIRES_GRAD, flagged)),
            values=values,
            snapshots=[snapshot(v) for v in values],
            scalers=scalers,
            scalers_enabled=scalers_enabled(scalers),
            empty=empty,
            tracked=bool(len(held) > 1 or empty or tensors or values or scalers),
        )

    def _module_tensors(self) -> list[Any]:
        out: list[Any] = []
        for d, is_tensor in self._dicts:
            if is_tensor:
                out.extend(v for v in d.values() if v is not None)
        return out

    def read(self, leaves: Sequence[Any], tree: Any, *, named: bool = False) -> StepGuard:
        """The guard of a call with these flattened arguments, now."""
        parts = _GuardParts(
            named,
            names=list(self._names) if named else [],
            tensor_names=list(self._tensor_names) if named else [],
        )
        for d, is_tensor in self._dicts:
            values = [v for v in d.values() if v is not None]
            parts.objects.extend(values)
            if is_tensor:
                parts.tensors.extend(values)
        for rname, read in self.targets.roots:
            parts.add_object(read(), lambda rname=rname: rname)  # type: ignore[misc]
        for tname, t in self.targets.tensors:
            parts.add_tensor(t, lambda tname=tname: tname)  # type: ignore[misc]
        # requires_grad matters for what the forward and backward record: the modules'
        # tensors and the step's own (an optimizer's state is updated under no_grad).
        parts.flagged = len(parts.tensors)
        for oname, opt in self.targets.optimizers:
            _read_optimizer(parts, oname, opt)
        for sname, scaler in self.targets.scalers:
            enabled = bool(getattr(scaler, "is_enabled", lambda: False)())
            parts.add_hyper(enabled, lambda sname=sname: f"{sname}.is_enabled()")  # type: ignore[misc]
        return parts.build(leaves, tree, self.params, self._param_names)

    def held(self) -> list[Any]:
        """The objects a guard names by id: a recording keeps them alive (so that
        no new object can take one's id while the guard lives)."""
        objects: list[Any] = []
        for d, _ in self._dicts:
            objects.extend(d.values())
        objects.extend(read() for _, read in self.targets.roots)
        objects.extend(t for _, t in self.targets.tensors)
        for _, opt in self.targets.optimizers:
            objects += [opt.param_groups, opt.state]
            for group in opt.param_groups:
                objects.append(group)
                objects.extend(group["params"])
                objects.extend(group.values())
                for p in group["params"]:
                    state = opt.state.get(p)
                    if state is not None:
                        objects.append(state)
                        objects.extend(state.values())
        objects.extend(p.grad for p in self.params)
        return objects


def _read_optimizer(parts: _GuardParts, oname: str, opt: torch.optim.Optimizer) -> None:
    """An optimizer's containers by identity, its parameters, and each group's and
    parameter state's values (:meth:`_GuardParts.add_value`)."""
    parts.add_object(opt.param_groups, lambda: f"{oname}.param_groups")
    parts.add_object(opt.state, lambda: f"{oname}.state")
    for gi, group in enumerate(opt.param_groups):
        at = f"{oname}.param_groups[{gi}]" if parts.named else ""
        parts.add_object(group, lambda at=at: at)  # type: ignore[misc]
        for k, p in enumerate(group["params"]):
            parts.add_object(p, lambda at=at, k=k: f"{at}['params'][{k}]")  # type: ignore[misc]
        for key, value in group.items():
            if key != "params":
                parts.add_value(value, lambda at=at, key=key: f"{at}[{key!r}]")  # type: ignore[misc]
        for p in group["params"]:
            state = opt.state.get(p)
            if state is None:
                parts.add_hyper(None, lambda: f"{oname}.state[p]")
                continue
            parts.add_object(state, lambda: f"{oname}.state[p]")
            for key, value in state.items():
                parts.add_value(value, lambda key=key: f"{oname}.state[p][{key!r}]")  # type: ignore[misc]
