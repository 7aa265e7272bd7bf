"""Why a node or a segment does not run as a CUDA graph, as typed data.

Every refusal is a :class:`Unsupported` carrying a :class:`CudagraphRefusalKind`, the
place it came from (the user's ``file:line`` when the node has a stack trace,
else the node name) and what to do instead. Refusals are plain values with no
``fx.Node`` references, so plans that hold them can be cached and compared.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from loom_sidefx import Refusal, RefusalError

__all__ = ["CudagraphError", "CudagraphRefusalKind", "Unsupported"]


class CudagraphRefusalKind(enum.Enum):
    """Why CUDA work runs uncaptured (every member is listed in docs/cudagraph.md)."""

    #: The node reads or writes a CPU tensor: capture records device work only.
    CPU_TENSOR = "cpu_tensor"
    #: The node copies between the host and a device (``.cpu()``, ``.cuda()``, ``.to``).
    DEVICE_COPY = "device_copy"
    #: The node needs a device value on the host (``.item()``, ``_local_scalar_dense``).
    SYNC_OP = "sync_op"
    #: The node's output shape depends on tensor data (``nonzero``, ``masked_select``).
    DATA_DEPENDENT_SHAPE = "data_dependent_shape"
    #: The op is in loom's non-capturable registry or carries ``torch.Tag.cudagraph_unsafe``.
    USER_MARKED = "user_marked"
    #: The op is a collective (``_c10d_functional``, ``c10d``).
    COLLECTIVE = "collective"
    #: The op saves or restores RNG state on the host (``run_and_save_rng_state``).
    RNG_STATE = "rng_state"
    #: A control-flow operator (``cond``, ``while_loop``) decides on the host.
    CONTROL_FLOW = "control_flow"
    #: The node produces a sparse tensor.
    SPARSE_TENSOR = "sparse_tensor"
    #: The node works on a second CUDA device; one graph captures one device.
    OTHER_DEVICE = "other_device"
    #: The node swaps an input's storage (``set_``), which a replay cannot repeat.
    INPUT_STORAGE_MUTATION = "input_storage_mutation"
    #: The segment has fewer nodes than ``min_segment_nodes``; capture would not pay.
    TOO_SMALL = "too_small"
    #: The segment met more distinct input shapes than ``max_shapes`` allows.
    DYNAMIC_SHAPE_BUDGET = "dynamic_shape_budget"
    #: The recording budget is spent: a segment's static input changed address (or its
    #: outputs stayed held) more often than ``max_recording`` allows, or a captured step
    #: met more guard sets than its ``max_recordings``.
    RECORDING_BUDGET = "recording_budget"
    #: A static input gets new memory on every call (its storage freed and allocated
    #: again, as FSDP2 does with unsharded parameters): each recording would replay once.
    INPUT_REALLOCATED = "input_reallocated"
    #: ``torch.cuda.graph`` capture itself raised; the segment (or step) runs uncaptured.
    CAPTURE_FAILED = "capture_failed"
    #: A caller switched CUDA graphs off for this graph (for example no CUDA device).
    DISABLED = "disabled"


@dataclasses.dataclass(frozen=True, slots=True)
class Unsupported(Refusal[CudagraphRefusalKind]):
    """What was refused, where, why, and what to do instead (a ``loom_sidefx.Refusal``).

    ``where`` is the user's source line (``file:line in fn``) when known, else
    the node's name. ``op`` names the operator (``aten.nonzero.default``).
    """

    op: str = ""
    #: Whether the refused work runs on a CUDA device (host-only work is no skip).
    cuda_work: bool = True

    def __str__(self) -> str:
        head = f"{self.op}: " if self.op else ""
        text = f"{head}{self.explanation} [{self.kind.value}]"
        if self.where:
            text += f" at {self.where}"
        return f"{text} (hint: {self.hint})" if self.hint else text

    def to_dict(self) -> dict[str, str | bool]:
        return {
            "kind": self.kind.value,
            "where": self.where,
            "explanation": self.explanation,
            "hint": self.hint,
            "op": self.op,
            "cuda_work": self.cuda_work,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Unsupported:
        return cls(
            CudagraphRefusalKind(data["kind"]),
            str(data["where"]),
            str(data["explanation"]),
            str(data.get("hint", "")),
            str(data.get("op", "")),
            bool(data.get("cuda_work", True)),
        )


class CudagraphError(RefusalError, RuntimeError):
    """Raised under ``cudagraph_or_error`` when CUDA work would run uncaptured."""

    reason: Unsupported

    def __init__(self, reason: Unsupported, graph: str = "") -> None:
        super().__init__(reason)
        where = f" in {graph}" if graph else ""
        self.args = (
            f"cudagraph_or_error: CUDA work left uncaptured{where}: {reason}. "
            "Unset cudagraph_or_error (or TORCHLOOM_CUDAGRAPH_OR_ERROR) to run it uncaptured.",
        )
