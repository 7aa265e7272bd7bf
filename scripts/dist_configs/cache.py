"""loom's cache across ranks: one directory shared by every rank, or one per rank.

Configurations (``--config``):

- ``cache``: the FSDP2 transformer compiled with loom and its cache on, both
  ranks sharing one ``TORCHLOOM_CACHE_DIR`` (``--cache-per-rank``: each rank its
  own ``<dir>/rank<N>``, as nodes with local caches). Each rank's cache entries
  from ``torchloom.report()`` are printed; every graph must be served on every
  rank or on none (``agreed_across_ranks``: the same hits and misses on every
  rank, one agreement per graph); with ``--expect-hits`` (the second ``torchrun``
  on the same directory) every rank must hit and none may miss.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from fsdp2_check import _gather

from .common import (
    _agrees,
    _compare,
    _compile_kwargs,
    _dynamo,
    _inputs,
    _report,
    _sharded,
    _steps,
    _transformer,
    _transformer_blocks,
)
from .ddp import _ddp_sequential
from .registry import register


@register("cache", order=90)
def run_cache(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    inputs = _inputs(args, device)
    sides = {}
    per_rank: list[Any] = []
    for side in ("eager", "loom"):
        model = _transformer(args, device)
        model = _sharded(model, _transformer_blocks(model))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if side == "eager":
            sides[side] = _steps(
                model, lambda x, m=model: m(x).square().mean(), inputs, opt, device
            )
            import torchloom

            torchloom.reset()
            continue
        with _dynamo(skip_fsdp_hooks=True):
            run = torch.compile(model, **_compile_kwargs(args))
            sides[side] = _steps(model, lambda x, r=run: r(x).square().mean(), inputs, opt, device)
        report = _report()
        # the DDP optimizer's bucket graphs too, from the same directory
        seq = _ddp_sequential(args, device, ("inner_compiled",))["inner_compiled"]
        counts = dict(report["entries"].get("cache", {}))
        for kind, n in seq["cache"].items():
            counts[kind] = counts.get(kind, 0) + n
        # NOTE: every rank says its own counts (under --nnodes each node's log has only
        # its ranks; scripts/two_node_cache.sh reads these lines from both)
        print(
            f"[cache] rank {dist.get_rank()} node {os.environ.get('GROUP_RANK', '0')} "
            f"local rank {os.environ.get('LOCAL_RANK', '0')}: hit {counts.get('hit', 0)} "
            f"miss {counts.get('miss', 0)} stored {counts.get('stored', 0)} "
            f"agreed {counts.get('agreed', 0)}",
            flush=True,
        )
        per_rank = _gather(counts)
    cmp = _compare(sides["eager"], sides["loom"])
    hits_ok = all(r.get("hit", 0) > 0 and not r.get("miss", 0) for r in per_rank)
    stored_ok = all(r.get("hit", 0) > 0 or r.get("stored", 0) > 0 for r in per_rank)
    # every graph served on every rank or on none (torchloom/_cache_ranks.py)
    agreed_ok = len({(r.get("hit", 0), r.get("miss", 0)) for r in per_rank}) == 1 and all(
        r.get("agreed", 0) == r.get("hit", 0) + r.get("miss", 0) for r in per_rank
    )
    ok = (
        _agrees(cmp, args.tol)
        and _agrees(seq, args.tol)
        and not report["fallbacks"]
        and (hits_ok if args.expect_hits else stored_ok)
        and agreed_ok
    )
    return {
        "verdict": "PASS" if ok else "FAIL",
        "expect_hits": args.expect_hits,
        "agreed_across_ranks": agreed_ok,
        "cache_dir_shared": _gather(os.environ.get("TORCHLOOM_CACHE_DIR")),
        "cache_per_rank": per_rank,
        "ddp_bucket_graphs": seq["graphs"],
        **cmp,
        **report,
    }
