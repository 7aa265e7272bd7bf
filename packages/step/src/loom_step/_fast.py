"""The per-call check of a recording: the question its full guard answers, at C speed.

A :class:`FastCheck` is precomputed from a call whose full
:class:`~loom_step._guard.StepGuard` matched, and holds only while nothing that
guard reads changed since. It compares live containers with the objects they
held then (by identity, at C speed), tensor addresses in one C++ call, and
arguments and modes through Dynamo's C++ guards where torch has them; when it
fails the call goes through the full guard, so it may answer "no" too often,
never "yes" wrongly.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from loom_step import _torch_compat as compat

__all__ = [
    "END",
    "MUTABLE",
    "NEVER",
    "REQUIRES_GRAD",
    "FastCheck",
    "args_check",
    "fast_values",
    "scalers_enabled",
    "snapshot",
    "unique_tensors",
]

REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: What the per-call check compares of a tensor argument (the class: a stand-in with the
#: same attributes is no tensor).
_TENSOR_KEY = operator.attrgetter("__class__", "shape", "dtype", "device", "requires_grad")
#: Ends every object stream of :class:`FastCheck`: a longer or shorter stream never matches.
END = object()
#: An expected gradient no call presents: the recording's fast check never holds.
NEVER: Any = object()
#: Values whose identity does not fix their value: compared with a copy, by value.
MUTABLE = (list, dict, set, bytearray)


def _value_key(v: Any) -> tuple[type, Any]:
    return (type(v), v)


def _arg_key(v: Any) -> Callable[[Any], Any]:
    return _TENSOR_KEY if isinstance(v, torch.Tensor) else _value_key


def args_check(args: Sequence[Any]) -> Callable[..., bool]:
    """A check that arguments (passed positionally, as many as ``args``) are like
    ``args``: one C++ call where all are tensors, else per argument in C-level maps."""
    if args and all(type(a) is torch.Tensor for a in args):
        check = compat.tensors_check(args)
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
    hyperparameter values by value, and each gradient scaler's enabled flag. A
    ``DTensor`` (FSDP2's parameters, gradients and optimizer state) has no memory of
    its own: its local tensor is compared by identity and address instead. The
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
    #: guarded ``DTensor``\ s and the local tensor each held (whose address is in ``tensors``)
    wrapped: list[torch.Tensor] = dataclasses.field(repr=False)
    locals: list[torch.Tensor] = dataclasses.field(repr=False)
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
                and compat.data_ptrs_equal(self.tensors, self.pointers, self.indices)
                and (
                    not self.wrapped
                    or all(map(operator.is_, map(compat.LOCAL_TENSOR, self.wrapped), self.locals))
                )
                and list(map(REQUIRES_GRAD, self.flagged)) == self.requires_grad
                and (not self.values or self.values == self.snapshots)
                and (not self.scalers or scalers_enabled(self.scalers) == self.scalers_enabled)
            )
        # NOTE: an argument or value whose == raises (a tensor's ambiguous truth
        # value, an array), an emptied closure cell: the full guard decides.
        except (RuntimeError, ValueError, TypeError):
            return False


def snapshot(value: Any) -> Any:
    """A copy of a mutable hyperparameter value to compare the live one with later
    (the value itself where it cannot be copied)."""
    try:
        return copy.deepcopy(value)
    except (TypeError, RuntimeError, copy.Error):  # uncopyable: compared by identity
        return value


def scalers_enabled(scalers: Iterable[Any]) -> list[bool]:
    return [bool(getattr(s, "is_enabled", lambda: False)()) for s in scalers]


def unique_tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return list({id(v): v for v in values if isinstance(v, torch.Tensor)}.values())


def fast_values(
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
        elif isinstance(v, MUTABLE):
            values.append(v)
