"""Run the training-loop corpus (``scripts/dist_configs/loops.py``) alone, with the
loops' own options: each loop against the same loop eager, under capture_step.

    torchrun --nproc-per-node 2 scripts/dist_loops.py                       # every loop
    torchrun --nproc-per-node 2 scripts/dist_loops.py --loop ddp fsdp2-clip
    torchrun --nproc-per-node 2 scripts/dist_loops.py --loop ddp --timed-only   # memory, alone
    torchrun --nproc-per-node 2 scripts/dist_loops.py --loop ddp --no-rehome    # the baseline

Rank 0 prints ``LOOP_RESULT {json}`` per loop and ``verdict: ...`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from dist_configs.loops import LOOP_DEFAULTS, LOOPS, run_loop, trace_raises
from fsdp2_check import _gather, _short_error


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--loop", choices=(*LOOPS, "all"), nargs="+", default=["all"])
    parser.add_argument("--steps", type=int, default=LOOP_DEFAULTS["steps"])
    parser.add_argument("--time-steps", type=int, default=LOOP_DEFAULTS["time_steps"])
    parser.add_argument("--warm-steps", type=int, default=LOOP_DEFAULTS["warm_steps"])
    parser.add_argument("--layers", type=int, default=LOOP_DEFAULTS["layers"])
    parser.add_argument("--dim", type=int, default=LOOP_DEFAULTS["dim"])
    parser.add_argument("--vocab", type=int, default=LOOP_DEFAULTS["vocab"])
    parser.add_argument("--seq", type=int, default=LOOP_DEFAULTS["seq"])
    parser.add_argument("--batch", type=int, default=LOOP_DEFAULTS["batch"])
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-rehome",
        action="store_true",
        help="leave DDP's reducer as built (the baseline the rebuild on the capture stream fixes)",
    )
    parser.add_argument("--compare-only", action="store_true", help="skip the timed runs")
    parser.add_argument(
        "--trace-raises", action="store_true", help="print every exception naming a capture"
    )
    parser.add_argument("--timed-only", action="store_true", help="skip the lockstep comparison")
    parser.add_argument(
        "--diagnose-memory", action="store_true", help="list live CUDA tensors after call 2"
    )
    args = parser.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    import torchloom

    if args.trace_raises:
        trace_raises()
    loops = LOOPS if "all" in args.loop else tuple(dict.fromkeys(args.loop))
    results = {}
    for name in loops:
        torchloom.reset()
        try:
            result, error = run_loop(name, args, device), None
        except Exception as exc:
            traceback.print_exc()
            result, error = {}, _short_error(exc)
        errors = _gather(error)
        verdicts = _gather(result.get("verdict"))
        if any(errors):
            result = {"verdict": "ERROR", "error": next(e for e in errors if e)}
        elif len(set(verdicts)) > 1:
            result["verdict_per_rank"] = verdicts
            result["verdict"] = "FAIL" if "FAIL" in verdicts else verdicts[0]
        result["peaks_vs_eager_per_rank"] = _gather(result.get("peak_vs_eager"))
        results[name] = {"loop": name, "ranks": dist.get_world_size(), **result}
        if rank == 0:
            print("LOOP_RESULT " + json.dumps(results[name], default=str), flush=True)
    if rank == 0:
        print("verdict: " + ", ".join(f"{k}={v['verdict']}" for k, v in results.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)
    failed = any(v["verdict"] in ("FAIL", "ERROR") for v in results.values())
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
