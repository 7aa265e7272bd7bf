"""Runtime side of saved-tensor hooks placed in graphs: guard, and no double packing.

A compilation that placed a pair in its graphs is valid while the innermost
active pair is *equal by content* to that pair (:func:`loom_hops.pair_mismatch`:
same code and defaults, and the traces' guards holding on the active pair's
closure and globals), not only while it is the very same two objects:
:func:`install_hooks_guard` adds that guard to the Dynamo frame being compiled,
so a call under other hooks (or none) recompiles, and Dynamo's cache of compiled
entries is the set of variants. While the compiled callable runs, autograd must
not apply the same hooks again to what it saves:
:func:`eager_saved_tensors_hooks_disabled`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from loom_hops import _torch_compat as compat
from loom_hops._hook_pair import HookPair, active_saved_tensors_hooks

if TYPE_CHECKING:
    from loom_hops._hook_graphs import HookGraphs

__all__ = [
    "eager_saved_tensors_hooks_disabled",
    "install_hooks_guard",
    "install_other_hooks_guard",
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
    """Guard the Dynamo frame being compiled on "the innermost active pair matches ``pair``".

    Matching is by content (:func:`loom_hops.pair_mismatch`): with ``graphs`` (the
    hooks as this compilation traced them) the traces' guards must hold on the
    active pair's closure and globals; without, every closure value must be equal.
    The guard holds ``pair`` alive. Call it from the backend, after compiling
    (Dynamo builds the frame's guards once the backend returns). Returns ``False``
    when no Dynamo compile is running.
    """

    if pair is None and graphs is None:
        # NOTE: every frame compiled without hooks carries this guard; it runs on each
        # call, so it is the one C call (no Python matching) when no pair is active.
        return compat.install_no_hooks_guard("loom: no saved_tensors_hooks are active")
    # NOTE: imported here, not per call: a frame compiled without hooks never matches.
    from loom_hops._hook_match import pair_mismatch

    def check() -> bool:
        return pair_mismatch(pair, active_saved_tensors_hooks(), graphs) is None

    what = "no saved_tensors_hooks" if pair is None else pair.describe()
    return compat.install_dynamo_guard(
        check, f"loom: active saved_tensors_hooks match {what} by content"
    )


def install_other_hooks_guard(
    variants: Sequence[tuple[HookPair | None, HookGraphs | None]],
) -> bool:
    """Guard the frame being compiled on "the active pair matches none of ``variants``".

    For a compilation that leaves the hooks eager and serves every pair the other
    compilations of the frame (``variants``, as given to :func:`install_hooks_guard`)
    do not, so that distinct pairs past a bound stop recompiling.
    """
    from loom_hops._hook_match import pair_mismatch

    kept = tuple(variants)

    def check() -> bool:
        active = active_saved_tensors_hooks()
        return all(pair_mismatch(p, active, g) is not None for p, g in kept)

    return compat.install_dynamo_guard(
        check, f"loom: active saved_tensors_hooks match none of {len(kept)} compiled pair(s)"
    )


@contextlib.contextmanager
def native_hook_inlining_disabled(pair: HookPair | None) -> Iterator[None]:
    """While compiling, keep AOTAutograd from inlining ``GraphModule`` hooks itself."""
    raw = None if pair is None else (pair.pack, pair.unpack)
    with compat.native_hook_inlining_disabled(raw):
        yield
