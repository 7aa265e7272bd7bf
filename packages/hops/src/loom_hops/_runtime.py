"""Runtime side of saved-tensor hooks placed in graphs: guard, and no double packing.

A compilation that placed a pair in its graphs is only valid while that very
pair is the innermost active one: :func:`install_hooks_guard` adds a guard to
the Dynamo frame being compiled, so a call under other hooks (or none)
recompiles, and Dynamo's cache of compiled entries is the bounded set of
variants (past Dynamo's ``recompile_limit`` the frame runs
eagerly, hooks included). While the compiled callable runs, autograd must not
apply the same hooks again to what it saves:
:func:`eager_saved_tensors_hooks_disabled`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from loom_hops import _torch_compat as compat
from loom_hops._hook_graphs import HookGraphs
from loom_hops._saved_hooks import HookPair, active_saved_tensors_hooks, same_pair

__all__ = [
    "eager_saved_tensors_hooks_disabled",
    "install_hooks_guard",
    "native_hook_inlining_disabled",
]

_DISABLED_MESSAGE = (
    "torchloom placed the active saved_tensors_hooks inside this compiled graph and "
    "disabled their eager application while it runs; a saved_tensors_hooks context "
    "entered inside the compiled call is not supported"
)


def eager_saved_tensors_hooks_disabled() -> contextlib.AbstractContextManager[None]:
    """Autograd saves tensors as they are inside the block (the graph already packed them)."""
    return compat.saved_tensors_hooks_disabled(_DISABLED_MESSAGE)


def install_hooks_guard(pair: HookPair | None, graphs: HookGraphs | None = None) -> bool:
    """Guard the Dynamo frame being compiled on "the innermost active pair is ``pair``".

    With ``graphs`` (traced Python hooks), the tracer's guards on closure and
    global values must hold too. The guard holds ``pair`` alive, so the
    identities it compares cannot be reused by other objects. Call it from the
    backend, after compiling (Dynamo builds the frame's guards once the backend
    returns). Returns ``False`` when no Dynamo compile is running.
    """

    def check() -> bool:
        if not same_pair(pair, active_saved_tensors_hooks()):
            return False
        return graphs is None or graphs.guards_hold()

    what = "no saved_tensors_hooks" if pair is None else pair.describe()
    return compat.install_dynamo_guard(check, f"loom: active saved_tensors_hooks is {what}")


@contextlib.contextmanager
def native_hook_inlining_disabled(pair: HookPair | None) -> Iterator[None]:
    """While compiling, keep AOTAutograd from inlining ``GraphModule`` hooks itself."""
    raw = None if pair is None else (pair.pack, pair.unpack)
    with compat.native_hook_inlining_disabled(raw):
        yield
