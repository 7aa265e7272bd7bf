"""loom's cache under two gloo ranks, each with its own cache directory: a graph is
served on every rank or on none (``torchloom/_cache_ranks.py``).

Before the process group starts, rank 0 fills its directory with ``f``, ``g`` and a
DDP model's bucket graphs (through a one-rank group), rank 1 with ``g`` only. Then,
with two ranks: ``f`` and the DDP buckets hit on rank 0 only, so both ranks compile
them; ``g`` hits on both, so both serve it. Outputs and gradients equal eager.
Nothing hangs: each rank has a process-group timeout and the test a subprocess
timeout. (Two processes cost about 30 s on a 2-core machine, mostly importing torch;
the agreement's logic is unit-tested in ``packages/torchloom/tests/test_cache_ranks.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import run_ranks

_WORKER = r"""
import datetime, json, os, sys, torch, torch.distributed as dist
import torchloom
from torch.nn.parallel import DistributedDataParallel as DDP

rank, init, fill_init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
EAGER = {"codegen": "eager"}
TIMEOUT = datetime.timedelta(seconds=60)

def f(x):
    return torch.tanh(x) * 2 + 1

def g(x):
    return torch.sin(x) * x - 1

class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x

def cache_kinds():
    return [e.kind for e in torchloom.report().entries("cache")]

def run(fn):
    torchloom.reset()
    x = torch.linspace(-2, 2, 8)
    got = torch.compile(fn, backend="loom", options=EAGER)(x)
    torch.testing.assert_close(got, fn(x))
    return cache_kinds()

def ddp_step():
    torchloom.reset()
    torch.manual_seed(0)
    model, ref = Layers(), Layers()
    ref.load_state_dict(model.state_dict())
    # NOTE: 1 MiB is the smallest cap Dynamo's DDP optimizer accepts; each Linear is
    # a bucket of its own
    ddp, ddp_ref = DDP(model, bucket_cap_mb=1), DDP(ref, bucket_cap_mb=1)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(rank))
    torch.compile(ddp, backend="loom", options=EAGER)(x).pow(2).sum().backward()
    ddp_ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    return cache_kinds()

# filling: rank 0 gets f, g and the DDP buckets, rank 1 g only
for fn in ((f, g) if rank == 0 else (g,)):
    run(fn)
if rank == 0:
    dist.init_process_group("gloo", init_method=fill_init, rank=0, world_size=1, timeout=TIMEOUT)
    ddp_step()
    dist.destroy_process_group()

dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=TIMEOUT)
out = {"f": run(f), "g": run(g), "ddp": ddp_step()}
messages = [e.message for e in torchloom.report().entries("cache") if e.kind == "miss"]
out["ddp_miss_messages"] = messages
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's cache report entries per compile."""
    root = tmp_path_factory.mktemp("cache-ranks")
    init, fill_init = f"file://{root / 'pg'}", f"file://{root / 'pg-fill'}"
    envs = [{"TORCHLOOM_CACHE_DIR": str(root / f"cache-rank{rank}")} for rank in (0, 1)]
    args = [(str(rank), init, fill_init) for rank in (0, 1)]
    unset = ("TORCHLOOM_REMOTE_CACHE", "TORCHLOOM_CACHE_AGREE")
    per_rank = run_ranks(_WORKER, args, envs, timeout=240, unset=unset)
    return [lines[0] for lines in per_rank]


def test_a_graph_cached_on_one_rank_only_is_compiled_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = ranks
    assert r0["f"] == r1["f"] == ["agreed", "miss", "stored"]


def test_a_graph_cached_on_every_rank_is_served_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = ranks
    assert r0["g"] == r1["g"] == ["agreed", "hit"]


def test_ddp_buckets_cached_on_one_rank_only_are_compiled_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = ranks
    buckets = r0["ddp"].count("agreed")
    assert buckets >= 2 and r1["ddp"].count("agreed") == buckets
    for r in (r0, r1):
        assert r["ddp"].count("miss") == buckets and "hit" not in r["ddp"]
    assert all("but rank 1 missed, so every rank compiles" in m for m in r0["ddp_miss_messages"])
