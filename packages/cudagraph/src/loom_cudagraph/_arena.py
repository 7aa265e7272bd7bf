"""Copy-in buffers shared by the recordings of one memory pool.

A captured segment reads each input it cannot read in place (not a parameter,
not an output of a loom CUDA graph, not at a stable address) from a buffer at
a fixed address: the call copies the input in, then replays. What such a
buffer holds matters from that copy to the end of the replay (and the copy
back of a mutated input), and the recordings of one pool run in program order
on one stream, so those spans never overlap: the recordings share their
buffers, handed out by (shape, stride, dtype, device). What stays allocated is
the largest set one recording needs (one layer's gathered weights under FSDP2),
not one set per recording.

Invariant: no output views a shared buffer (a later recording would overwrite
it while the output lives); an input position that an output aliases gets a
buffer of its own (:func:`own_buffer`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

__all__ = ["CopyArena", "own_buffer"]

_Key = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def own_buffer(like: torch.Tensor) -> torch.Tensor:
    """A buffer of ``like``'s shape, strides, dtype and device (allocated outside any pool)."""
    return torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device=like.device)


class CopyArena:
    """The copy-in buffers of one pool's recordings, held weakly: a buffer lives
    as long as a recording that reads it (its memory goes with the last one)."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[_Key, list[weakref.ref[torch.Tensor]]] = {}

    def lend(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One buffer per tensor of ``like`` (distinct within the call), reusing the
        buffers of earlier calls: the k-th request of a key gets that key's k-th buffer."""
        taken: dict[_Key, int] = {}
        lent = []
        for t in like:
            key = (tuple(t.size()), tuple(t.stride()), t.dtype, t.device)
            k = taken.get(key, 0)
            taken[key] = k + 1
            slots = self._slots.setdefault(key, [])
            buf = slots[k]() if k < len(slots) else None
            if buf is None:
                buf = own_buffer(t)
                if k < len(slots):
                    slots[k] = weakref.ref(buf)
                else:
                    slots.append(weakref.ref(buf))
            lent.append(buf)
        return lent

    def held_bytes(self) -> int:
        """Bytes of the live buffers (for reports and tests)."""
        total = 0
        for slots in self._slots.values():
            for ref in slots:
                buf = ref()
                if buf is not None:
                    total += buf.untyped_storage().nbytes()
        return total
