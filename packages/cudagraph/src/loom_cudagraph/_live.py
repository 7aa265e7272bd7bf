"""The CUDA-graph runtimes alive in this process, and :func:`release_graphs`.

Apart from the runtime module, so that ``torch._dynamo.reset()`` (which calls
every backend's reset) imports nothing where no runtime was ever built.
"""

from __future__ import annotations

import weakref
from typing import Protocol

__all__ = ["live_runtimes", "release_graphs"]


class _Releasable(Protocol):
    def release(self) -> None: ...


#: Every runtime built and not yet collected (the runtime module adds each one).
live_runtimes: weakref.WeakSet[_Releasable] = weakref.WeakSet()


def release_graphs() -> None:
    """Drop the CUDA graphs of every live runtime of the process: their memory pools
    go back to the device once the outputs they handed out are gone. The runtimes
    stay callable and record again on their next call."""
    for runtime in list(live_runtimes):
        runtime.release()
