"""Gradient hooks with Python side effects that Dynamo keeps inside one graph.

``y = grad_hook(y, fn)`` is ``y = y.clone(); y.register_hook(fn)`` built from
two custom ops instead of a Python call Dynamo must trace: ``loom::grad_tap``
(identity forward that also makes a per-call *token*) and, in its backward,
``loom::grad_hook`` (runs the hooks bound to that token). Dynamo keeps custom
ops in the graph, so a hook that appends to a list or counts calls no longer
breaks it.

The hooks reach the runtime through Dynamo's own side-effect replay: each
traced call site gets a trace-time constant :class:`_Site` object
(``assume_constant_result``, no guard) and the traced code stores
``site.fns = fns``, which Dynamo replays after the forward graph with the hook
objects *of that call* (a closure recreated per call is the new closure). Invariant: a token is bound to the hooks stored right
after the graph that made it, i.e. to the hooks of its own forward call; a
forward that raised between the two leaves its token unbound and is dropped
by the next call of that site.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.fx

__all__ = ["bound_hook_count", "grad_hook"]

log = logging.getLogger("torchloom.hops")

GradHook = Callable[[torch.Tensor], torch.Tensor | None]

#: Never recomputed in backward (the partitioner bans random ops), never CSE'd
#: or dead-code eliminated (impure); runs outside CUDA graphs (Python side effects).
_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.cudagraph_unsafe)

_numbers = itertools.count()
_tokens = itertools.count(1)
_lock = threading.Lock()


class _Site:
    """One ``grad_hook`` call site of one trace; ``fns`` is written by Dynamo's replay."""

    __slots__ = ("__weakref__", "fns", "last", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        self.fns: tuple[GradHook, ...] | None = None
        self.last: tuple[GradHook, ...] | None = None


#: site number -> its site (kept alive by the compiled code that holds it as a constant).
_sites: weakref.WeakValueDictionary[int, _Site] = weakref.WeakValueDictionary()
#: site number -> token made by the latest forward call, not yet paired with its hooks.
_unbound: dict[int, int] = {}
#: token -> hooks; an entry lives as long as its token tensor (the autograd graph).
_bound: dict[int, tuple[GradHook, ...]] = {}


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _new_site() -> _Site:
    """A fresh call site: a constant in each Dynamo trace, fresh per eager call."""
    site = _Site(next(_numbers))
    _sites[site.number] = site
    return site


def _settle(number: int) -> None:
    with _lock:
        site = _sites.get(number)
        if site is not None and site.fns is not None and number in _unbound:
            _bound[_unbound.pop(number)] = site.last = site.fns
            site.fns = None


def _forget(token: int, number: int) -> None:
    with _lock:
        _bound.pop(token, None)
        if _unbound.get(number) == token:
            del _unbound[number]


def bound_hook_count() -> int:
    """How many forward calls still hold hooks (each is freed with its autograd graph)."""
    return len(_bound)


def _check_callable(fns: tuple[GradHook, ...]) -> None:
    # NOTE: not in the traced part of grad_hook: Dynamo 2.11 cannot evaluate
    # callable() on a bound builtin such as `sink.append`.
    for fn in fns:
        if not callable(fn):
            raise TypeError(
                f"torchloom.grad_hook: a hook must be callable, got {type(fn).__name__}"
            )


@torch.library.custom_op("loom::grad_tap", mutates_args=(), tags=_TAGS)
def _grad_tap(y: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    _settle(site)  # the previous call of this site, whose hooks are stored by now
    token = next(_tokens)
    handle = torch.tensor(token, dtype=torch.int64)
    weakref.finalize(handle, _forget, token, site)
    with _lock:
        _unbound[site] = token
    return y.clone(), handle


@_grad_tap.register_fake
def _grad_tap_fake(y: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(y), torch.empty((), dtype=torch.int64)


def hooks_of(token: torch.Tensor) -> tuple[GradHook, ...]:
    """The hooks of the forward call that made ``token`` (pairs every pending call first)."""
    for site in list(_unbound):
        _settle(site)
    key = int(token.item())
    fns = _bound.get(key)
    if fns is None:
        raise RuntimeError(
            f"torchloom.grad_hook: no hooks are bound to the backward of forward call {key}: "
            "its forward raised before Dynamo stored the hooks, or another thread ran the same "
            "compiled region between the forward graph and that store. Run the forward and "
            "backward of one compiled region on one thread at a time."
        )
    _check_callable(fns)
    return fns


def last_hooks(site: int) -> tuple[GradHook, ...] | None:
    """The hooks most recently paired at ``site`` (what a backward compiler may trace)."""
    _settle(site)
    entry = _sites.get(site)
    return None if entry is None else entry.last


def check_hook_result(fn: GradHook, result: object, grad: torch.Tensor) -> torch.Tensor | None:
    """``result`` of ``fn(grad)`` if it is a gradient like ``grad`` or None; else raise."""
    if result is None:
        return None
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"torchloom.grad_hook: hook {getattr(fn, '__qualname__', fn)!r} returned "
            f"{type(result).__name__}; a gradient hook returns a Tensor or None"
        )
    if result.shape != grad.shape or result.dtype != grad.dtype:
        raise RuntimeError(
            f"torchloom.grad_hook: hook {getattr(fn, '__qualname__', fn)!r} returned a "
            f"gradient of shape {tuple(result.shape)} and dtype {result.dtype} for a tensor "
            f"of shape {tuple(grad.shape)} and dtype {grad.dtype}; return a gradient "
            "like the one it was given"
        )
    return result


def run_hooks(grad: torch.Tensor, fns: Sequence[GradHook]) -> torch.Tensor:
    """Run ``fns`` in order as Python on ``grad``; return a fresh tensor (the new gradient)."""
    # NOTE: the hooks see a private copy: Inductor may reuse the storage of `grad`
    # once this op has read it, and a hook may keep what it is given.
    current = grad.clone()
    for fn in fns:
        result = check_hook_result(fn, fn(current), grad)
        if result is not None:
            current = result
    # NOTE: a custom op may not return (a view of) its input nor a tensor a hook kept.
    return current.clone()


@torch.library.custom_op("loom::grad_hook", mutates_args=(), tags=_TAGS)
def _run_grad_hooks(grad: torch.Tensor, token: torch.Tensor, site: int) -> torch.Tensor:
    return run_hooks(grad, hooks_of(token))


@_run_grad_hooks.register_fake
def _run_grad_hooks_fake(grad: torch.Tensor, token: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _setup_context(
    ctx: object, inputs: tuple[object, ...], output: tuple[torch.Tensor, ...]
) -> None:
    ctx.save_for_backward(output[1])  # type: ignore[attr-defined]
    ctx.site = inputs[1]  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad: torch.Tensor, grad_token: torch.Tensor | None
) -> tuple[torch.Tensor, None]:
    (token,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return torch.ops.loom.grad_hook(grad, token, ctx.site), None  # type: ignore[attr-defined]


_grad_tap.register_autograd(_backward, setup_context=_setup_context)


def grad_hook(y: torch.Tensor, *fns: GradHook) -> torch.Tensor:
    """Return a tensor equal to ``y`` whose gradient passes through ``fns`` in order.

    The same as ``y = y.clone(); y.register_hook(fn)`` for each ``fn``: a hook
    may return a new gradient or ``None`` and may have Python side effects. Use
    the returned tensor from then on; uses of ``y`` itself are not hooked.
    Inside ``torch.compile`` it is two custom ops, so it does not break the
    graph (``fullgraph=True`` works) and each forward call's backward runs the
    hook objects of that call.

    >>> grads = []
    >>> @torch.compile(backend="loom", fullgraph=True)
    ... def f(x):
    ...     y = grad_hook(x * 2, lambda g: grads.append(g))
    ...     return (y * y).sum()

    Pass ``lambda g: grads.append(g)`` rather than ``grads.append``: Dynamo
    guards on the length of a list whose bound method it sees, so the latter
    recompiles each time the list grows.
    """
    if not fns:
        raise TypeError("torchloom.grad_hook(y, *fns) needs at least one hook")
    if not y.requires_grad:
        raise RuntimeError(
            "torchloom.grad_hook: cannot hook a tensor that doesn't require grad "
            "(as Tensor.register_hook); compute it from a tensor with requires_grad=True "
            "outside torch.no_grad()"
        )
    site = _new_site()
    out, _token = torch.ops.loom.grad_tap(y, site.number)
    site.fns = fns
    if not torch.compiler.is_compiling():
        _check_callable(fns)
        _settle(site.number)
    return out  # type: ignore[no-any-return]
