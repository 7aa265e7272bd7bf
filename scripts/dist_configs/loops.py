"""The training-loop corpus: loops as users write them, each against the same loop eager.

GPU only. Each loop registers itself as a configuration of its own (the runner imports
this module, so a new loop needs no edit there)::

    from .registry import register

    @register("loop-ddp-clip", gpu_only=True)
    def run_loop_ddp_clip(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
        if device.type != "cuda":
            return {"verdict": "SKIP", "reason": "GPU only: CUDA graphs need CUDA devices and NCCL"}
        ...
        return {"verdict": "PASS" if ok else "FAIL", ...}

Without an ``order``, configurations run after the other families' under
``--config all``, in the order they are registered here.
"""

from __future__ import annotations
