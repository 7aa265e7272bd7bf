"""Guards: the conditions under which a traced hook is valid, compiled into one closure.

The tracer resolves control flow on tensor metadata, closure cells and globals
at trace time; every value it specialized on becomes a ``Guard`` on that
value's source. ``compile_guards`` turns a guard list into a single Python
function of the hook's arguments (one generated expression, objects bound by
identity), cheap enough to run on every call; it returns ``False`` rather
than raising when a source no longer resolves.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .replay import _stable_repr
from .sources import GlobalSource, Source


class GuardKind(enum.Enum):
    TENSOR_MATCH = "tensor_match"  # dtype, shape, stride, device, requires_grad
    EQUALS = "equals"  # same type and ==
    IDENTITY = "identity"  # the same object
    TYPE_MATCH = "type_match"  # type(x) is T
    LEN_EQUALS = "len_equals"
    GLOBAL_ABSENT = "global_absent"  # the name is not defined in that globals dict
    SAME_AS = "same_as"  # the same object as another source (aliasing seen while tracing)
    DISTINCT_FROM = "distinct_from"  # not the same object as another source (no aliasing seen)
    DICT_KEYS = "dict_keys"  # the keys, in order
    INSTANCE_ATTR_ABSENT = "instance_attr_absent"  # the name is not in the object's __dict__


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a trace specialized on for one tensor input; ``None`` marks a symbolic size."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]
    stride: tuple[int | None, ...]
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        def static(values: tuple[Any, ...]) -> tuple[int | None, ...]:
            return tuple(v if isinstance(v, int) else None for v in values)

        return TensorMeta(
            t.dtype, static(tuple(t.shape)), static(tuple(t.stride())), t.device, t.requires_grad
        )

    @property
    def is_static(self) -> bool:
        return None not in self.shape and None not in self.stride

    def describe(self) -> str:
        def text(values: tuple[int | None, ...]) -> str:
            return "[" + ", ".join("?" if v is None else str(v) for v in values) + "]"

        return f"{self.dtype} {text(self.shape)} stride={text(self.stride)} {self.device} rg={self.requires_grad}"


@dataclass(frozen=True, slots=True)
class Guard:
    """``source`` must still satisfy ``kind`` with ``expected`` for the trace to apply."""

    source: Source
    kind: GuardKind
    expected: Any = field(compare=False)

    @property
    def key(self) -> str:
        """Identifies a guard for de-duplication (source, kind and expected value)."""
        return self.describe()

    def describe(self) -> str:
        return f"{self.source.describe()} {self.kind.value} {describe_expected(self.kind, self.expected)}"


def describe_expected(kind: GuardKind, expected: Any) -> str:
    """Process-stable text for an expected value (no addresses, no salted hashes)."""
    if kind is GuardKind.TENSOR_MATCH:
        assert isinstance(expected, TensorMeta)
        return expected.describe()
    if kind is GuardKind.IDENTITY:
        return describe_object(expected)
    if kind is GuardKind.TYPE_MATCH:
        return f"{expected.__module__}.{expected.__qualname__}"
    if kind in (GuardKind.SAME_AS, GuardKind.DISTINCT_FROM):
        return str(expected.describe())
    return _stable_repr(expected)


def describe_object(obj: object) -> str:
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.BuiltinFunctionType):
        return f"builtin {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    return f"instance of {type(obj).__module__}.{type(obj).__qualname__}"


GuardFn = Callable[[Sequence[Any]], bool]


def compile_guards(guards: Sequence[Guard]) -> tuple[GuardFn, str]:
    """Compile ``guards`` into one function ``fn(args) -> bool``; also return its source text."""
    namespace: dict[str, Any] = {"_Tensor": torch.Tensor}
    by_id: dict[int, str] = {}

    def bind(obj: object) -> str:
        name = by_id.get(id(obj))
        if name is None:
            name = f"_o{len(by_id)}"
            by_id[id(obj)] = name
            namespace[name] = obj
        return name

    conditions: list[str] = []
    for guard in guards:
        conditions.extend(_conditions(guard, bind))
    body = " and\n            ".join(conditions) if conditions else "True"
    text = f"def guard(args):\n    try:\n        return bool(\n            {body}\n        )\n    except Exception:\n        return False\n"
    exec(compile(text, "<loom_hops guards>", "exec"), namespace)
    fn: GuardFn = namespace["guard"]
    return fn, text


def _conditions(guard: Guard, bind: Callable[[object], str]) -> list[str]:
    kind, expected = guard.kind, guard.expected
    if kind is GuardKind.GLOBAL_ABSENT:
        assert isinstance(guard.source, GlobalSource)
        return [f"{guard.source.name!r} not in {bind(guard.source.namespace)}"]
    x = guard.source.expr(bind)
    if kind is GuardKind.TENSOR_MATCH:
        assert isinstance(expected, TensorMeta)
        checks = [f"isinstance({x}, _Tensor)", f"{x}.dtype is {bind(expected.dtype)}"]
        if expected.is_static:
            checks += [f"{x}.shape == {expected.shape!r}", f"{x}.stride() == {expected.stride!r}"]
        else:
            # Symbolic sizes are left to the shape environment that made them.
            checks.append(f"{x}.dim() == {len(expected.shape)}")
            checks += [
                f"{x}.size({i}) == {v}" for i, v in enumerate(expected.shape) if v is not None
            ]
            checks += [
                f"{x}.stride({i}) == {v}" for i, v in enumerate(expected.stride) if v is not None
            ]
        return [
            *checks,
            f"{x}.device == {bind(expected.device)}",
            f"{x}.requires_grad is {expected.requires_grad!r}",
        ]
    if kind is GuardKind.EQUALS:
        if expected is None or isinstance(expected, bool):
            return [f"{x} is {expected!r}"]
        if isinstance(expected, torch.dtype):
            return [f"{x} is {bind(expected)}"]
        return [f"type({x}) is {bind(type(expected))}", f"{x} == {bind(expected)}"]
    if kind is GuardKind.IDENTITY:
        return [f"{x} is {bind(expected)}"]
    if kind is GuardKind.TYPE_MATCH:
        return [f"type({x}) is {bind(expected)}"]
    if kind is GuardKind.SAME_AS:
        return [f"{x} is {expected.expr(bind)}"]
    if kind is GuardKind.DISTINCT_FROM:
        return [f"{x} is not {expected.expr(bind)}"]
    if kind is GuardKind.DICT_KEYS:
        return [f"tuple({x}) == {bind(tuple(expected))}"]
    if kind is GuardKind.LEN_EQUALS:
        return [f"len({x}) == {int(expected)}"]
    if kind is GuardKind.INSTANCE_ATTR_ABSENT:
        return [f"{str(expected)!r} not in {x}.__dict__"]
    raise AssertionError(kind)
