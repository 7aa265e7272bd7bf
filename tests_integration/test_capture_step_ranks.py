"""capture_step under DDP with two gloo ranks on the host (``HostCapturer`` stands
in for CUDA graphs: a capture runs the step once more, a replay runs it again).

Every decision a step makes is agreed across the ranks (the minimum of each rank's
proposal, ``loom_step/_distributed.py``): one rank given another batch shape makes
every rank run that call eagerly, and its new recording makes every rank record; a
capture that fails on one rank is refused on both. Nothing hangs: each rank has a
process-group timeout and the test a subprocess timeout. (Two processes cost about
40 s on a 2-core machine, mostly importing torch, so this lives here, not in the
unit tests of ``packages/step``.)
"""

from __future__ import annotations

from typing import Any

import pytest
from ranks import run_ranks

from loom_step._distributed import DDP_WARMUP

_WORKER = r"""
import datetime, json, sys, torch, torch.distributed as dist
import loom_cudagraph
from torch.nn.parallel import DistributedDataParallel as DDP
from loom_step import CapturedStep, StepOptions

rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
def run(scenario):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp, ref = DDP(model()), DDP(model())
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

    capturer = Failing() if scenario == "fail" else loom_cudagraph.HostCapturer()
    step = CapturedStep(train_step, StepOptions(warmup=2), capturer=capturer)
    gen = torch.Generator().manual_seed(10 + rank)
    classes, last = [], step.stats()
    for call in range(1, 18):
        batch = 8 if (scenario == "shape" and rank == 1 and call in (14, 15)) else 16
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
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    s = step.stats()
    print(json.dumps({"scenario": scenario, "classes": classes, "warmup": s.warmup_calls, "agreed": s.agreed_calls,
                      "overruled": s.overruled_calls, "state": s.state.value,
                      "refusal": str(s.refusal) if s.refusal else None,
                      "rerecords": list(s.rerecords)}))

for scenario in ("shape", "fail"):
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
