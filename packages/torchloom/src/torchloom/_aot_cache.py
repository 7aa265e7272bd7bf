"""AOTAutograd's cache slots, routed to one loom compilation.

PyTorch's AOTAutogradCache only serves Inductor's own compiler. Loom's cache
reuses its machinery for loom's compilers: during one compilation,
AOTAutograd's ``try_load`` / ``make_entry`` / ``save`` slots are routed to an
:class:`AotCacheSlot`, so a cold compile captures the bundled result (runtime
metadata, wrappers, serialized compiled forward/backward) and a hit rebuilds
the runtime from it without tracing, partitioning or codegen. Nothing reaches
PyTorch's own cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

from torchloom import _torch_compat as compat

__all__ = [
    "AotCacheSlot",
    "CacheNotServed",
    "aot_cache_slot",
    "lazy_backward_lowering",
    "route_lazy_backward_save",
]


class CacheNotServed(Exception):
    """Raised from AOTAutograd's ``try_load`` when a serve-only slot could not serve
    its entry: nothing was traced yet, and the caller compiles cold instead."""


@dataclasses.dataclass
class AotCacheSlot:
    """One compilation's exchange with AOTAutograd's cache slots.

    ``load``: a pickled result to serve (a hit), or ``None`` (a cold compile).
    ``serve_only``: a load that fails raises :class:`CacheNotServed` instead of
    letting AOTAutograd compile. After the compilation: ``loaded`` says whether
    it was served; ``load_error`` why not; ``saved`` holds the pickled result of a
    cold compilation, ``save_error`` why there is none; ``save_attempted`` is false
    while AOTAutograd has not tried to save yet (its backward is compiled lazily,
    at the first backward).
    """

    key: str
    load: bytes | None = None
    serve_only: bool = False
    loaded: bool = False
    load_error: str | None = None
    saved: bytes | None = None
    save_error: str | None = None
    save_attempted: bool = False


@contextlib.contextmanager
def aot_cache_slot(slot: AotCacheSlot) -> Iterator[None]:
    """Route AOTAutograd's cache slots to ``slot`` for the compilation inside.

    The backward is compiled now, so that the entry is complete when the
    compilation returns, unless :func:`lazy_backward_lowering` says otherwise
    inside; then see :func:`route_lazy_backward_save`.
    """
    with _routed_to(slot, serve=True), compat.backward_lowering(lazy=False):
        yield


def lazy_backward_lowering() -> contextlib.AbstractContextManager[None]:
    """Inside :func:`aot_cache_slot`: compile the backward at its first call after all
    (AOTAutograd then makes and saves the entry right after that compile)."""
    return compat.backward_lowering(lazy=True)


def route_lazy_backward_save(slot: AotCacheSlot, saved: Callable[[], None]) -> Callable[[], None]:
    """Route the entry AOTAutograd saves after a lazily compiled backward to ``slot``.

    Call it from the backward compiler (AOTAutograd makes and saves the entry
    right after it returns); ``saved()`` runs once the slot holds the result (or
    ``save_error``). Returns a function that undoes the routing if no save came.
    """
    while _armed:  # a backward compile that raised after arming never saved
        _armed[-1]()
    stack = contextlib.ExitStack()

    def finish() -> None:
        if finish in _armed:
            _armed.remove(finish)
            stack.close()

    def on_save() -> None:
        finish()
        saved()

    stack.enter_context(_routed_to(slot, serve=False, on_save=on_save))
    _armed.append(finish)
    return finish


_armed: list[Callable[[], None]] = []


@contextlib.contextmanager
def _routed_to(
    slot: AotCacheSlot, *, serve: bool, on_save: Callable[[], None] | None = None
) -> Iterator[None]:
    """AOTAutograd's try_load (with ``serve``), make_entry and save slots, routed to ``slot``."""
    cache = compat.autograd_cache()
    original_make_entry = cache.make_entry

    def load(args: list[Any], aot_config: Any, fx_config: dict[str, Any]) -> Any:
        if slot.load is not None:
            try:
                entry = pickle.loads(slot.load)
                guards = entry.guards_expr
                symints = compat.backed_symints(args)
                if guards and not compat.entry_guards_hold(guards, symints):
                    raise LookupError(f"shape guards of the stored entry fail: {guards}")
                compiled = entry.wrap_post_compile(args, aot_config, fx_config)
                compat.publish_entry_fw_metadata(entry)
                slot.loaded = True
                return compiled
            except compat.CONTROL_FLOW_EXCEPTIONS:
                raise
            except Exception as err:  # a bad entry is a miss, never a failed compile
                slot.load_error = f"{type(err).__name__}: {err}"
            if slot.serve_only:
                raise CacheNotServed(slot.load_error)
        return None

    def make_entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_make_entry(*args, **kwargs)
        except compat.CONTROL_FLOW_EXCEPTIONS:
            raise
        except Exception as err:
            slot.save_error = f"the compiled graphs are not serializable: {err}"
            return None

    def save(key: str, entry: Any, remote: bool) -> None:
        if key != slot.key:
            return
        slot.save_attempted = True
        try:
            if entry is not None:
                entry.pre_save()
                slot.saved = pickle.dumps(entry)
        except compat.CONTROL_FLOW_EXCEPTIONS:
            raise
        except Exception as err:
            slot.save_error = f"{type(err).__name__}: {err}"
        if on_save is not None:
            on_save()

    saved_attrs = {name: cache.__dict__[name] for name in ("try_load", "make_entry", "save")}
    try:
        if serve:
            cache.try_load = staticmethod(compat.aot_try_load_slot(slot.key, load))
        cache.make_entry = staticmethod(make_entry)
        cache.save = staticmethod(save)
        with compat.autograd_cache_forced():
            yield
    finally:
        for name, value in saved_attrs.items():
            setattr(cache, name, value)
