"""loom's features under FSDP2 (``fully_shard``) and DDP, each against eager.

Run with two ranks (``torchrun`` or ``python -m torch.distributed.run``)::

    torchrun --nproc-per-node 2 scripts/dist_check.py                 # CUDA + NCCL, all configs
    torchrun --nproc-per-node 2 scripts/dist_check.py --device cpu    # gloo on CPU
    torchrun --nproc-per-node 2 scripts/dist_check.py --config ddp ddp-cg

Configurations (``--config``, several allowed; default: all) live in the package
``dist_configs`` beside this script, one module per family, each describing its own:

- ``dist_configs/fsdp2.py``: ``fsdp2-hooks``, ``fsdp2-hf``, ``fsdp2-ca-hf``,
  ``fsdp2-cudagraphs`` (loom's graphs under FSDP2);
- ``dist_configs/ddp.py``: ``ddp``, ``ddp-cg`` (``torch.compile(DDP(model))``);
- ``dist_configs/capture.py``: ``ddp-step``, ``ddp-step-small``, ``fsdp2-step``
  (whole steps under ``torchloom.capture_step`` against a raw CUDA graph);
- ``dist_configs/cache.py``: ``cache`` (one cache directory across ranks);
- ``dist_configs/loops.py``: the training-loop corpus.

What they share (arguments, models, the training run, the verdict against eager) is
``dist_configs/common.py``; ``dist_configs/registry.py`` files each configuration
under its name (``@register("name")``), and this runner runs what is registered.

For each configuration rank 0 prints one line ``DIST_RESULT {json}`` (the
verdict ``PASS``/``FAIL``/``ERROR``/``SKIP`` and the figures); the tests parse
those lines. The process exits 0 when no configuration failed.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from dist_configs.common import parse_args
from dist_configs.registry import configs as registered
from fsdp2_check import _gather, _short_error

#: The family modules; importing one registers its configurations.
FAMILIES = ("fsdp2", "ddp", "capture", "cache", "loops")
for _family in FAMILIES:
    importlib.import_module(f"dist_configs.{_family}")

CONFIGS = tuple(c.name for c in registered())
GPU_ONLY = tuple(c.name for c in registered() if c.gpu_only)
RUNNERS = {c.name: c.run for c in registered()}


def main() -> int:
    args = parse_args(CONFIGS, (__doc__ or "").split("\n")[0])
    cuda = args.device == "cuda"

    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    if args.cache_per_rank:  # before any compile: the cache reads it at its first use
        root = os.environ.get("TORCHLOOM_CACHE_DIR") or os.path.expanduser("~/.cache/torchloom")
        os.environ["TORCHLOOM_CACHE_DIR"] = os.path.join(root, f"rank{rank}")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    import torchloom

    def say(s: str) -> None:
        if rank == 0:
            print(s, flush=True)

    say(
        f"torch {torch.__version__}, {dist.get_world_size()} ranks, {device.type} "
        f"({dist.get_backend()}), dim {args.dim}, seq {args.seq}, {args.steps} steps, "
        f"codegen {args.codegen}"
    )
    configs = CONFIGS if "all" in args.config else tuple(dict.fromkeys(args.config))
    results: dict[str, Any] = {}
    for name in configs:
        say(f"[{name}] running ...")
        torchloom.reset()
        try:
            result = RUNNERS[name](args, device)
            error = None
        except Exception as exc:  # report and go on with the next configuration
            # NOTE: the whole traceback, on this rank's stderr: after a CUDA fault the
            # gather below raises too, and the first error would be lost.
            traceback.print_exc()
            sys.stderr.flush()
            result, error = {}, _short_error(exc)
        errors = _gather(error)
        if any(errors):
            result = {
                "verdict": "ERROR",
                "ranks": [i for i, e in enumerate(errors) if e],
                "error": next(e for e in errors if e),
            }
        else:
            # NOTE: each rank judges its own gradients; the configuration passes only
            # where every rank passed (rank 0 prints the verdict for all of them).
            verdicts = _gather(result.get("verdict"))
            if len(set(verdicts)) > 1:
                order = ("ERROR", "FAIL", "UNSUPPORTED", "SKIP", "PASS")
                worst = min(verdicts, key=lambda v: order.index(v) if v in order else 0)
                result = {**result, "verdict": worst, "verdict_per_rank": verdicts}
        results[name] = result = {"config": name, "device": device.type, **result}
        say("DIST_RESULT " + json.dumps(result, default=str))
    say("verdict: " + ", ".join(f"{k}={v['verdict']}" for k, v in results.items()))
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    failed = any(v["verdict"] in ("FAIL", "ERROR") for v in results.values())
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: leave without the interpreter's teardown: after a traced FSDP2 run on
    # gloo, a C++ thread still joinable at static destruction aborts the process
    # ("terminate called without an active exception") after every result is out.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
