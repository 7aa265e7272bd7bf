"""capture_step under DDP and FSDP2 with two gloo ranks on the host (``HostCapturer``
stands in for CUDA graphs: a capture runs the step once more, a replay runs it again).

Every decision a step makes is agreed across the ranks (the minimum of each rank's
proposal, ``loom_step/_distributed.py``): one rank given another batch shape makes
every rank run that call eagerly, and its new recording makes every rank record; a
capture that fails on one rank is refused on both. An FSDP2 step (``fully_shard`` per
block and at the root, which runs on CPU with gloo in torch 2.11) takes its uncaptured
path with the CUDA capturer (no CUDA: refused together at the first call) and equals
eager FSDP2; with the host capturer it warms up for FSDP2's two calls, and one rank's
other batch shape is agreed as under DDP. Nothing hangs: each rank has a
process-group timeout and the test a subprocess timeout. (Two processes cost about
40 s on a 2-core machine, mostly importing torch, so this lives here, not in the
unit tests of ``packages/step``.)
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import run_ranks

from loom_step._distributed import DDP_WARMUP, FSDP2_WARMUP

_WORKER = r"""
import datetime, json, sys, torch, torch.distributed as dist
import loom_cudagraph
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from loom_step import CapturedStep, StepOptions

rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
def run(scenario):
    fsdp2 = scenario.startswith("fsdp2")
    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        if not fsdp2:
            return DDP(m)
        fully_shard(m[0])
        fully_shard(m[2])
        return fully_shard(m)
    ddp, ref = model(), model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    class Failing(loom_cudagraph.HostCapturer):
        # NOTE: fails at its end, as a CUDA capture invalidated midway (which ran nothing,
        # while the host stand-in ran the step's collectives: both ranks must run them)
        def capture_call(self, fn, pool, keep=()):
            made = super().capture_call(fn, pool, keep)
            if rank == 1:
                raise RuntimeError("operation not permitted when stream is capturing")
            return made

    if scenario == "fsdp2-uncaptured":  # the CUDA capturer, on the host: refused
        step = CapturedStep(train_step, StepOptions(warmup=1))
    else:
        capturer = Failing() if scenario == "fail" else loom_cudagraph.HostCapturer()
        step = CapturedStep(train_step, StepOptions(warmup=1 if fsdp2 else 2), capturer=capturer)
    gen = torch.Generator().manual_seed(10 + rank)
    classes, last = [], step.stats()
    other = (14, 15) if scenario == "shape" else (6, 7) if scenario == "fsdp2-shape" else ()
    for call in range(1, 18 if not fsdp2 else 10):
        batch = 8 if (rank == 1 and call in other) else 16
        x, y = torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen)
        got = step(x, y)
        ref_opt.zero_grad()
        want = torch.nn.functional.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
        s = step.stats()
        if s.recordings > last.recordings:
            classes.append("capture")
        elif s.replays > last.replays:
            classes.append("replay")
        else:
            classes.append("eager")
        last = s
    for p, q in zip(ddp.parameters(), ref.parameters()):
        if fsdp2:  # DTensor shards: the whole parameter (a collective on both ranks)
            p, q = p.full_tensor(), q.full_tensor()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    s = step.stats()
    print(json.dumps({"scenario": scenario, "classes": classes, "warmup": s.warmup_calls, "agreed": s.agreed_calls,
                      "slow": s.slow_calls, "fsdp2_params": sum(type(p).__name__ == "DTensor" for p in ddp.parameters()),
                      "overruled": s.overruled_calls, "state": s.state.value,
                      "refusal": str(s.refusal) if s.refusal else None,
                      "rerecords": list(s.rerecords)}))

for scenario in ("shape", "fail", "fsdp2-uncaptured", "fsdp2-shape"):
    run(scenario)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each scenario's result on rank 0 and rank 1."""
    init = f"file://{tmp_path_factory.mktemp('pg') / 'store'}"
    out: dict[str, list[dict[str, Any]]] = {}
    for lines in run_ranks(_WORKER, [(str(rank), init) for rank in (0, 1)]):
        for result in lines:
            out.setdefault(result["scenario"], []).append(result)
    return out


def test_a_rank_with_another_batch_shape_makes_every_rank_decide_alike(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    r0, r1 = ranks["shape"]
    # DDP: 11 warm-up calls (its timer logging and bucket rebuild), then a recording
    want = ["eager"] * DDP_WARMUP + ["capture", "replay"]
    # call 14: rank 1's new shape warms up, rank 0 runs eagerly instead of replaying;
    # call 15: rank 1 records it, rank 0 records its own guard set again
    want += ["eager", "capture", "replay", "replay"]
    assert r0["classes"] == r1["classes"] == want
    assert r0["warmup"] == r1["warmup"] - 1 == DDP_WARMUP
    assert r0["agreed"] == r1["agreed"] == len(want)
    assert r0["overruled"] == 2 and r1["overruled"] == 0
    assert r0["rerecords"] == ["another rank recorded a new guard set at this call"]
    assert r0["state"] == r1["state"] == "captured"


def test_a_capture_failing_on_one_rank_is_refused_on_every_rank(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    r0, r1 = ranks["fail"]
    want = ["eager"] * 17  # the failed capture's call runs eagerly on both ranks
    assert r0["classes"] == r1["classes"] == want
    assert r0["state"] == r1["state"] == "uncaptured"
    assert r1["refusal"].startswith("[capture_failed]")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in r1["refusal"]  # a DDP step's hint
    assert "rank 1 failed to capture, so every rank does: [capture_failed]" in r0["refusal"]
    # once refused together, the ranks stop agreeing (no collective per call)
    assert r0["agreed"] == r1["agreed"] == DDP_WARMUP + 1


def test_an_fsdp2_step_on_the_host_runs_uncaptured_and_equals_eager_fsdp2(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    r0, r1 = ranks["fsdp2-uncaptured"]
    # every parameter is a DTensor shard; losses and parameters equal eager FSDP2's
    # (asserted in the worker, every call)
    assert r0["fsdp2_params"] == r1["fsdp2_params"] == 4
    assert r0["classes"] == r1["classes"] == ["eager"] * 9
    assert r0["state"] == r1["state"] == "uncaptured"
    assert r0["refusal"].startswith("[no_cuda]") and r1["refusal"].startswith("[no_cuda]")
    # decided together once (an FSDP2 step agrees), then no collective per call
    assert r0["agreed"] == r1["agreed"] == 1 and r0["warmup"] == r1["warmup"] == 0


def test_an_fsdp2_step_warms_up_twice_and_a_rank_with_another_shape_is_agreed(
    ranks: dict[str, list[dict[str, Any]]],
) -> None:
    r0, r1 = ranks["fsdp2-shape"]
    # warmup=1 asked, FSDP2's lazy init and a steady call: 2 warm-ups, then a recording
    want = ["eager"] * FSDP2_WARMUP + ["capture", "replay", "replay"]
    # call 6: rank 1's new shape warms up, rank 0 runs eagerly instead of replaying;
    # call 7: rank 1 records it, rank 0 records its own guard set again
    want += ["eager", "capture", "replay", "replay"]
    assert r0["classes"] == r1["classes"] == want
    assert r0["warmup"] == r1["warmup"] - 1 == FSDP2_WARMUP
    assert r0["agreed"] == r1["agreed"] == len(want)
    assert r0["overruled"] == 2 and r1["overruled"] == 0
    assert r0["rerecords"] == ["another rank recorded a new guard set at this call"]
    assert r0["state"] == r1["state"] == "captured" and r0["refusal"] is None
    # the per-call check holds on DTensor shards (guarded by their local tensors): calls
    # 4, 6 (then overruled) and 8 pass it on rank 0. (On the host stand-in a replay runs
    # the step again, and FSDP2's backward leaves new gradient objects, so the call after
    # a per-call replay takes the full guard; a CUDA replay leaves the gradients as set.)
    assert r0["slow"] == len(want) - 3
