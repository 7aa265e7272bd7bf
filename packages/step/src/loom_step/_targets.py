"""Which modules, optimizers, gradient scalers and tensors a step uses.

Found once, from the step function's closure, defaults, bound ``self`` and the
globals its code names (helper functions it calls included, two levels deep),
plus what the caller passes as ``track=``. Each is kept with the name the
step's code knows it by, and with a way to read that name again, so that a
rebound name shows as a changed object in the guard.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

__all__ = ["StepTargets", "find_targets"]


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
