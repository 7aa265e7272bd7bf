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

Which modules and optimizers a step uses is found once, from the step function's
closure, defaults, bound ``self`` and the globals its code names
(:func:`find_targets`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import inspect
import itertools
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from torchloom import _torch_compat as compat

__all__ = [
    "ANY_TENSOR",
    "NEVER",
    "FastCheck",
    "GuardKind",
    "GuardMismatch",
    "StepGuard",
    "StepProbe",
    "StepTargets",
    "TensorSpec",
    "find_targets",
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


@dataclasses.dataclass(frozen=True, slots=True)
class StepTargets:
    """The modules, optimizers and gradient scalers a step uses, with the names
    the step's code knows them by."""

    modules: tuple[tuple[str, torch.nn.Module], ...] = ()
    optimizers: tuple[tuple[str, torch.optim.Optimizer], ...] = ()
    scalers: tuple[tuple[str, Any], ...] = ()
    #: Tensors the step reads from its closure or globals (used in place by a replay).
    tensors: tuple[tuple[str, torch.Tensor], ...] = ()
    #: How to read each name again (a closure cell, a global, an attribute): a
    #: rebound name shows as a changed object.
    roots: tuple[tuple[str, Callable[[], Any]], ...] = ()

    def params(self) -> list[torch.Tensor]:
        """Every parameter of the modules and optimizers, once each, in a fixed order."""
        seen: dict[int, torch.Tensor] = {}
        for _, m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        for _, opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())


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
    gradient's ``(id, data_ptr)``; a recording's guard may hold :data:`ANY_TENSOR`
    where the step replaces the gradient it finds.
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


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: What the per-call check compares of a tensor argument (the class: a stand-in with the
#: same attributes is no tensor).
_TENSOR_KEY = operator.attrgetter("__class__", "shape", "dtype", "device", "requires_grad")
_OPT_CONTAINERS = operator.attrgetter("param_groups", "state")
#: Ends every object stream of :class:`FastCheck`: a longer or shorter stream never matches.
_END = object()
#: An expected gradient no call presents: the recording's fast check never holds.
NEVER: Any = object()
#: Values whose identity does not fix their value: compared with a copy, by value.
_MUTABLE = (list, dict, set, bytearray)


def _value_key(v: Any) -> tuple[type, Any]:
    return (type(v), v)


def _arg_key(v: Any) -> Callable[[Any], Any]:
    return _TENSOR_KEY if isinstance(v, torch.Tensor) else _value_key


def _args_check(args: Sequence[Any]) -> Callable[..., bool]:
    """A check that arguments (passed positionally, as many as ``args``) are like
    ``args``: one C++ call where all are tensors, else per argument in C-level maps."""
    if args and all(type(a) is torch.Tensor for a in args):
        check = compat.step_tensors_check(args)
        if check is not None:
            return check
    keys = tuple(map(_arg_key, args))
    specs = [key(a) for key, a in zip(keys, args, strict=True)]

    def match(*now: Any) -> bool:
        return list(map(operator.call, keys, now)) == specs

    return match


@dataclasses.dataclass(frozen=True, slots=True)
class FastCheck:
    """The per-call check of a recording, precomputed from a call whose full
    :class:`StepGuard` matched (its capture, or a replay after a full check).

    It holds only if nothing that guard reads changed since: the arguments' (positional,
    then the keyword ones' values, their names in the same order) class, shape, dtype,
    device and ``requires_grad`` (others: type and value), grad mode, autocast and
    its cache (one C++ call) and the autocast dtypes, every guarded
    object by identity (one pass over live dict views and lists at C speed, gradients
    included, ending in a sentinel so that a set that grew or shrank never matches),
    every guarded tensor's address (one C++ call) and ``requires_grad``, mutable
    hyperparameter values by value, and each gradient scaler's enabled flag. The
    objects compared by identity are held here, so no new object takes one's id.
    """

    #: how many arguments (positional, then keyword values), and their check (called
    #: with them)
    nargs: int
    args_match: Callable[..., bool]
    global_state: Callable[[], bool]
    autocast_dtypes: tuple[torch.dtype, torch.dtype]
    #: the guarded objects now, in a fixed order (a fresh iterator per call)
    stream: Callable[[], Iterator[Any]] = dataclasses.field(repr=False)
    held: list[Any] = dataclasses.field(repr=False)
    tensors: list[torch.Tensor] = dataclasses.field(repr=False)
    pointers: list[int | None] = dataclasses.field(repr=False)
    indices: list[int] = dataclasses.field(repr=False)
    #: tensors whose ``requires_grad`` the full guard compares, and their flags
    flagged: list[torch.Tensor] = dataclasses.field(repr=False)
    requires_grad: list[bool] = dataclasses.field(repr=False)
    #: mutable hyperparameter or state values, and copies of them
    values: list[Any] = dataclasses.field(repr=False)
    snapshots: list[Any] = dataclasses.field(repr=False)
    scalers: tuple[Any, ...] = ()
    scalers_enabled: list[bool] = dataclasses.field(default_factory=list)
    #: the names of the keyword arguments, in call order (their values end the arguments)
    keywords: tuple[str, ...] = ()
    #: module dicts that were empty (compared by length)
    empty: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: whether any object, tensor, value or scaler is guarded (else arguments and modes
    #: are the whole check)
    tracked: bool = True

    def matches(self, args: Sequence[Any]) -> bool:
        """Whether a call with these arguments (positional, then keyword values) may
        replay now."""
        try:
            if not (
                len(args) == self.nargs
                and self.args_match(*args)
                and self.global_state()
                and torch.get_autocast_dtype("cuda") == self.autocast_dtypes[0]
                and torch.get_autocast_dtype("cpu") == self.autocast_dtypes[1]
            ):
                return False
            if not self.tracked:
                return True
            return (
                all(map(operator.is_, self.stream(), self.held))
                and not any(map(len, self.empty))
                and compat.step_data_ptrs_equal(self.tensors, self.pointers, self.indices)
                and list(map(_REQUIRES_GRAD, self.flagged)) == self.requires_grad
                and (not self.values or self.values == self.snapshots)
                and (not self.scalers or _scalers_enabled(self.scalers) == self.scalers_enabled)
            )
        # NOTE: an argument or value whose == raises (a tensor's ambiguous truth
        # value, an array), an emptied closure cell: the full guard decides.
        except (RuntimeError, ValueError, TypeError):
            return False


def _snapshot(value: Any) -> Any:
    """A copy of a mutable hyperparameter value to compare the live one with later
    (the value itself where it cannot be copied)."""
    try:
        return copy.deepcopy(value)
    except (TypeError, RuntimeError, copy.Error):  # uncopyable: compared by identity
        return value


def _scalers_enabled(scalers: Iterable[Any]) -> list[bool]:
    return [bool(getattr(s, "is_enabled", lambda: False)()) for s in scalers]


def _unique_tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return list({id(v): v for v in values if isinstance(v, torch.Tensor)}.values())


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
                _fast_values((v for k, v in group.items() if k != "params"), views, values, inner)
            for state in opt.state.values():
                views.append(state.values())
                _fast_values(state.values(), views, values, inner)
        reads = tuple(read for _, read in self.targets.roots)
        params = tuple(self.params)
        end = (_END,)

        def stream() -> Iterator[Any]:
            return itertools.chain(
                itertools.chain.from_iterable(views),
                map(operator.call, reads),
                itertools.chain.from_iterable(map(_OPT_CONTAINERS, opts)),
                map(_GRAD, params),
                end,
            )

        now = list(stream())
        held = [*now[: len(now) - len(params) - 1], *grads, _END]
        flagged = _unique_tensors([*self._module_tensors(), *(t for _, t in self.targets.tensors)])
        tensors = _unique_tensors([*now[: len(now) - len(params) - 1], *inner, *flagged, *grads])
        scalers = tuple(s for _, s in self.targets.scalers)
        return FastCheck(
            nargs=len(args),
            args_match=_args_check(args),
            keywords=keywords,
            global_state=compat.step_global_state(mode_state),
            autocast_dtypes=(torch.get_autocast_dtype("cuda"), torch.get_autocast_dtype("cpu")),
            stream=stream,
            held=held,
            tensors=tensors,
            pointers=[t.data_ptr() for t in tensors],
            indices=list(range(len(tensors))),
            flagged=flagged,
            requires_grad=list(map(_REQUIRES_GRAD, flagged)),
            values=values,
            snapshots=[_snapshot(v) for v in values],
            scalers=scalers,
            scalers_enabled=_scalers_enabled(scalers),
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
        objects: list[Any] = []
        tensors: list[torch.Tensor] = []
        for d, is_tensor in self._dicts:
            values = [v for v in d.values() if v is not None]
            objects.extend(values)
            if is_tensor:
                tensors.extend(values)
        hyper: list[Any] = []
        hyper_names: list[str] = []
        opt_names: list[str] = []
        opt_tensor_names: list[str] = []
        objects.extend(read() for _, read in self.targets.roots)
        for _, t in self.targets.tensors:
            objects.append(t)
            tensors.append(t)
        # requires_grad matters for what the forward and backward record: the modules'
        # tensors and the step's own (an optimizer's state is updated under no_grad).
        flagged = len(tensors)
        if named:
            opt_names += [name for name, _ in self.targets.roots]
            opt_names += [name for name, _ in self.targets.tensors]
            opt_tensor_names += [name for name, _ in self.targets.tensors]
        for oname, opt in self.targets.optimizers:
            objects.append(opt.param_groups)
            objects.append(opt.state)
            if named:
                opt_names += [f"{oname}.param_groups", f"{oname}.state"]
            for gi, group in enumerate(opt.param_groups):
                objects.append(group)
                objects.extend(group["params"])
                if named:
                    opt_names.append(f"{oname}.param_groups[{gi}]")
                    opt_names += [
                        f"{oname}.param_groups[{gi}]['params'][{k}]"
                        for k in range(len(group["params"]))
                    ]
                for key, value in group.items():
                    if key == "params":
                        continue
                    _split_value(
                        value,
                        f"{oname}.param_groups[{gi}][{key!r}]",
                        objects,
                        tensors,
                        hyper,
                        hyper_names,
                        opt_names,
                        opt_tensor_names,
                        named,
                    )
                for p in group["params"]:
                    state = opt.state.get(p)
                    if state is None:
                        hyper.append(None)
                        if named:
                            hyper_names.append(f"{oname}.state[p]")
                        continue
                    objects.append(state)
                    if named:
                        opt_names.append(f"{oname}.state[p]")
                    for key, value in state.items():
                        _split_value(
                            value,
                            f"{oname}.state[p][{key!r}]",
                            objects,
                            tensors,
                            hyper,
                            hyper_names,
                            opt_names,
                            opt_tensor_names,
                            named,
                        )
        for sname, scaler in self.targets.scalers:
            hyper.append(bool(getattr(scaler, "is_enabled", lambda: False)()))
            if named:
                hyper_names.append(f"{sname}.is_enabled()")
        grads = tuple(None if (g := p.grad) is None else (id(g), g.data_ptr()) for p in self.params)
        return StepGuard(
            tree=tree,
            args=tuple(_leaf_spec(v) for v in leaves),
            modes=mode_state(),
            objects=tuple(map(id, objects)),
            pointers=tuple(t.data_ptr() for t in tensors),
            requires_grad=tuple(t.requires_grad for t in tensors[:flagged]),
            hyper=tuple(hyper),
            grads=grads,
            names=(*self._names, *opt_names) if named else (),
            tensor_names=(*self._tensor_names, *opt_tensor_names) if named else (),
            hyper_names=tuple(hyper_names) if named else (),
            param_names=self._param_names if named else (),
        )

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


def _split_value(
    value: Any,
    name: str,
    objects: list[Any],
    tensors: list[torch.Tensor],
    hyper: list[Any],
    hyper_names: list[str],
    opt_names: list[str],
    opt_tensor_names: list[str],
    named: bool,
) -> None:
    """A hyperparameter or state value: tensors are guarded by identity and address
    (a replay reads their current value), anything else by value."""
    if isinstance(value, torch.Tensor):
        objects.append(value)
        tensors.append(value)
        if named:
            opt_names.append(name)
            opt_tensor_names.append(name)
    elif isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value):
        for k, v in enumerate(value):
            _split_value(
                v,
                f"{name}[{k}]",
                objects,
                tensors,
                hyper,
                hyper_names,
                opt_names,
                opt_tensor_names,
                named,
            )
    else:
        # A mutable value (a list of floats) is kept as a copy: the live one, changed in
        # place, would still compare equal to itself.
        hyper.append(_snapshot(value) if isinstance(value, _MUTABLE) else value)
        if named:
            hyper_names.append(name)


def _fast_values(
    found: Iterable[Any], views: list[Iterable[Any]], values: list[Any], inner: list[torch.Tensor]
) -> None:
    """What :class:`FastCheck` compares of hyperparameter and state values besides their
    identity: the elements of a list or tuple holding tensors (a list's live, as a view;
    their addresses), and the value of any other mutable value."""
    for v in found:
        if isinstance(v, tuple | list) and any(isinstance(x, torch.Tensor) for x in v):
            inner += [x for x in v if isinstance(x, torch.Tensor)]
            if isinstance(v, list):
                views.append(v)
        elif isinstance(v, _MUTABLE):
            values.append(v)


# --- finding a step's modules and optimizers ---------------------------------------------


def find_targets(fn: Callable[..., Any], extra: Iterable[Any] = ()) -> StepTargets:
    """The modules, optimizers, gradient scalers and tensors ``fn`` reaches: its
    closure cells, defaults, bound ``self`` (and that object's attributes) and the
    globals its code (nested code included) names; plus ``extra`` objects."""
    found: dict[int, tuple[str, Any]] = {}
    roots: list[tuple[str, Callable[[], Any]]] = []

    def wanted(obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module | torch.optim.Optimizer | torch.Tensor) or (
            _is_scaler(obj)
        )

    def add(name: str, obj: Any, read: Callable[[], Any] | None, depth: int = 0) -> None:
        if wanted(obj):
            if read is not None:
                roots.append((name, read))
            found.setdefault(id(obj), (name, obj))
        elif depth == 0 and isinstance(obj, list | tuple):
            for k, v in enumerate(obj):
                add(f"{name}[{k}]", v, None, 1)
        elif depth == 0 and isinstance(obj, dict):
            for k, v in obj.items():
                add(f"{name}[{k!r}]", v, None, 1)
        elif (
            depth == 0
            and hasattr(obj, "__dict__")
            and not callable(obj)
            and not isinstance(obj, types.ModuleType)
        ):
            attrs = vars(obj)
            for k, v in list(attrs.items()):
                add(f"{name}.{k}", v, functools.partial(attrs.get, k), 1)

    seen_code: set[int] = set()

    def scan(target: Any, prefix: str, depth: int) -> None:
        """The closure, defaults and named globals of a Python function; a plain
        function found there (a helper the step calls) is scanned too."""
        code = getattr(target, "__code__", None)
        if code is None or id(code) in seen_code or depth > _HELPER_DEPTH:
            return
        seen_code.add(id(code))
        helpers: list[tuple[str, Any]] = []

        def visit(name: str, value: Any, read: Callable[[], Any] | None) -> None:
            if _is_user_function(value):
                helpers.append((name, value))
            else:
                add(prefix + name, value, read)

        cells = getattr(target, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, cells, strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            visit(name, value, functools.partial(_cell_contents, cell))
        for k, v in enumerate(getattr(target, "__defaults__", None) or ()):
            visit(f"default[{k}]", v, None)
        for k, v in (getattr(target, "__kwdefaults__", None) or {}).items():
            visit(k, v, None)
        glob = getattr(target, "__globals__", {})
        for name in dict.fromkeys(_code_names(code)):
            if name in glob:
                visit(name, glob[name], functools.partial(glob.get, name))
        for name, helper in helpers:
            scan(helper, f"{prefix}{name}.", depth + 1)

    for i, obj in enumerate(extra):
        add(f"track[{i}]", obj, None)
    target: Any = inspect.unwrap(fn)
    bound = getattr(target, "__self__", None)
    if bound is not None:
        add("self", bound, None)
        attrs = getattr(bound, "__dict__", {})
        for k, v in list(attrs.items()):
            add(f"self.{k}", v, functools.partial(attrs.get, k), 1)
        target = getattr(target, "__func__", target)
    if isinstance(target, torch.nn.Module):
        add("module", target, None)
        target = type(target).forward
    scan(target, "", 0)
    values = list(found.values())
    modules = [(n, o) for n, o in values if isinstance(o, torch.nn.Module)]
    # A submodule of a tracked module is guarded through its parent, and so are
    # the parameters and buffers of tracked modules.
    inner = {id(sub) for _, m in modules for sub in list(m.modules())[1:]}
    owned = {id(t) for _, m in modules for t in (*m.parameters(), *m.buffers())}
    return StepTargets(
        modules=tuple((n, m) for n, m in modules if id(m) not in inner),
        optimizers=tuple((n, o) for n, o in values if isinstance(o, torch.optim.Optimizer)),
        scalers=tuple((n, o) for n, o in values if _is_scaler(o)),
        tensors=tuple(
            (n, o) for n, o in values if isinstance(o, torch.Tensor) and id(o) not in owned
        ),
        roots=tuple(roots),
    )


#: How deep helper functions called by the step are scanned for modules and optimizers.
_HELPER_DEPTH = 2


def _is_user_function(value: Any) -> bool:
    """A plain Python function outside torch and loom (a helper of the step)."""
    module = getattr(value, "__module__", None) or ""
    return isinstance(value, types.FunctionType) and not module.startswith(
        ("torch", "torchloom", "loom_")
    )


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _code_names(const)
    return names


def _is_scaler(obj: Any) -> bool:
    return isinstance(obj, GradScaler)


# Re-exported for the step runtime: flattening is the one private torch API it needs.
tree_flatten = compat.step_tree_flatten
tree_unflatten = compat.step_tree_unflatten
