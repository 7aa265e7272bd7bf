"""Guard predicates the tracer adds to ``loom_sidefx`` guards (``GuardKind.PREDICATE``).

``loom_sidefx`` is torch-free; the checks that need torch live here:
``TensorMeta`` (a tensor input's dtype, shape, stride, device and
requires_grad) and ``EqualTo`` (an immutable value that is not a
``loom_sidefx`` constant, such as a ``range``). Importing it registers the
torch atoms (``torch.dtype``, ``torch.device``, ...) as ``loom_sidefx``
constants. Both describe
themselves as process-stable text (``stable_repr``), used in fingerprints.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from loom_sidefx import register_constant_type

#: Torch atoms recorded, used as keys and guarded like builtin constants.
TORCH_CONSTANT_TYPES: tuple[type, ...] = (
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)
for _cls in TORCH_CONSTANT_TYPES:
    register_constant_type(_cls)


def stable_repr(value: object) -> str:
    """repr without addresses or hash-seed-dependent ordering."""
    if isinstance(value, (frozenset, set)):
        return "{" + ", ".join(sorted(stable_repr(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(stable_repr(v) for v in value) + ",)"
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, types.ModuleType):
        return f"<module {value.__name__}>"
    if callable(value) and not isinstance(value, (int, float, complex, str)):
        qualname = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<callable {getattr(value, '__module__', None)}.{qualname}>"
    if isinstance(value, BaseException):
        return f"{type(value).__qualname__}{stable_repr(value.args)}"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(stable_repr(v) for v in value) + "]"
    return repr(value)


def describe_object(obj: object) -> str:
    """Process-stable text naming an object held by identity."""
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.BuiltinFunctionType):
        return f"builtin {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    return f"instance of {type(obj).__module__}.{type(obj).__qualname__}"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a trace specialized on for one tensor input; ``None`` marks a symbolic size.

    Called on a value, it checks that value (a ``GuardPredicate``); symbolic
    sizes are left to the shape environment that made them.
    """

    dtype: torch.dtype
    shape: tuple[int | None, ...]
    stride: tuple[int | None, ...]
    device: torch.device
    requires_grad: bool
    _static: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_static", None not in self.shape and None not in self.stride)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        def static(values: tuple[Any, ...]) -> tuple[int | None, ...]:
            return tuple(v if isinstance(v, int) else None for v in values)

        return TensorMeta(
            t.dtype, static(tuple(t.shape)), static(tuple(t.stride())), t.device, t.requires_grad
        )

    def __call__(self, value: Any) -> bool:
        if self._static:
            return (
                isinstance(value, torch.Tensor)
                and value.dtype is self.dtype
                and value.shape == self.shape
                and value.stride() == self.stride
                and value.device == self.device
                and value.requires_grad is self.requires_grad
            )
        if not isinstance(value, torch.Tensor) or value.dtype is not self.dtype:
            return False
        if value.dim() != len(self.shape):
            return False
        for i, (size, stride) in enumerate(zip(self.shape, self.stride, strict=True)):
            if (size is not None and value.size(i) != size) or (
                stride is not None and value.stride(i) != stride
            ):
                return False
        return value.device == self.device and value.requires_grad is self.requires_grad

    def describe(self) -> str:
        def text(values: tuple[int | None, ...]) -> str:
            return "[" + ", ".join("?" if v is None else str(v) for v in values) + "]"

        return (
            f"tensor_match<{self.dtype} {text(self.shape)} stride={text(self.stride)} "
            f"{self.device} rg={self.requires_grad}>"
        )


@dataclass(frozen=True, slots=True)
class EqualTo:
    """The value has exactly ``type(expected)`` and equals it (immutable non-builtin constants)."""

    expected: Any

    def __call__(self, value: Any) -> bool:
        return type(value) is type(self.expected) and bool(value == self.expected)

    def describe(self) -> str:
        return f"equal_to<{stable_repr(self.expected)}>"
