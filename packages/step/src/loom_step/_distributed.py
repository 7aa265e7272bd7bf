"""A step that trains with DDP, and the ranks agreeing on what each call does.

**DDP.** ``DistributedDataParallel`` synchronizes with the host in its own forward:
for its first 10 iterations, and every ``sample_rate``-th (100) after, it reads the
CUDA timer events of the previous iteration on the host (``_pre_forward``:
``self.logger.set_runtime_stats_and_log()``), and after its first iteration it
rebuilds its gradient buckets (new bucket memory, a broadcast of the order).
PyTorch's whole-network capture recipe for DDP runs 11 eager iterations first. A
step whose targets include a DDP module is warmed up for :data:`DDP_WARMUP` calls
at least, and its DDP modules' runtime-logging sample rate is set so high that no
later iteration (a re-recording's capture included) reads the timers again.

DDP's reducer keeps each parameter's ``AccumulateGrad`` node from DDP's construction
on, and a node records the stream current when it was made. Built as the tutorial
builds it, on the default stream, every backward under a capture then accumulates on
the legacy default stream, which cannot join a capture (the capture fails). On CUDA,
a step's first call rebuilds each DDP's reducer on the stream its warm-ups and
captures run on (:func:`rehome_ddp_accumulators`), as if DDP had been built under
``torch.cuda.stream(that_stream)``: the nodes then accumulate on the capture stream
itself.

**FSDP2.** ``fully_shard`` runs its all-gathers and reduce-scatters eagerly, on
side streams it makes at its lazy init (the root's first forward): copy-in and
all-gather streams that wait on the current stream at the root's pre-forward,
a reduce-scatter stream that waits on it before each reduction, events between
them, and unsharded parameters whose storage it resizes to full before use and
to 0 after. Under a capture each side stream joins the graph through its first
wait on the capture stream, allocations there come from the graph's pool, and
every event FSDP2 records in a step is waited on in that step; nothing crosses
the step's end (its final backward callback clears them). So a step with
FSDP2 modules is warmed up for :data:`FSDP2_WARMUP` calls at least (lazy init,
NCCL's communicators, the optimizer's state), and its capture ends by joining
each FSDP2 stream that took part back into the capture stream
(:func:`join_capturing`). Refused before a capture (:func:`fsdp2_refusal`):
parameters offloaded to the host (the optimizer step runs on the host) and a
post-optimizer event (``set_post_optim_event``: recorded in one step, waited on
in the next).

**Ranks.** Every decision a step makes (replay, warm up, capture, run uncaptured,
refuse) must be the same on every rank: a rank that captures while another replays
or runs eagerly issues its collectives differently (a capture records them and a
replay launches them; on the host stand-in a capture runs them once more), and a
rank that compiles while others wait pushes them towards the collective timeout.
When the step involves a process group (a DDP module, or an FSDP-sharded one) and
that group has more than one rank, each call's decision is the minimum over the
ranks of each rank's :class:`Action` (lower is more conservative), agreed with one
``all_reduce`` of one integer over a gloo group (the DDP's own when it is gloo, else
a gloo group over the same ranks made on the first call): no device work, no
device synchronization.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loom_step import _torch_compat as compat
from loom_step._refusals import StepRefusalKind, StepUnsupported
from loom_step._targets import StepTargets

__all__ = [
    "DDP_WARMUP",
    "FSDP2_CAPTURE_HINT",
    "FSDP2_WARMUP",
    "Action",
    "RankAgreement",
    "ddp_modules",
    "fsdp2_modules",
    "fsdp2_refusal",
    "fsdp2_streams",
    "join_capturing",
    "quiet_ddp_timers",
    "rank_agreement",
    "rehome_ddp_accumulators",
]

log = logging.getLogger("torchloom.capture_step")

#: Eager DDP iterations before a capture (PyTorch's recipe: DDP's timer logging
#: covers its first 10 iterations, its bucket rebuild the second).
DDP_WARMUP = 11
#: Eager FSDP2 calls before a capture: the first runs FSDP2's lazy init (its streams,
#: the root's no-reshard setting, re-padded shards), NCCL's communicator set-up and
#: the optimizer's state; the second is a steady step like every later one.
FSDP2_WARMUP = 2
#: DDP's runtime-logging sample rate under capture_step: the timers are read in the
#: first 10 iterations only (DDP reads them when ``iteration % rate == 0``).
DDP_SAMPLE_RATE = 2**31 - 1


class Action(enum.IntEnum):
    """What one call of a step does, ordered from the most conservative: the ranks
    agree on the minimum of their proposals."""

    #: Refuse for good (every later call runs the step as written).
    REFUSE = 0
    #: Run this call uncaptured (a spent recording budget, another rank's warm-up).
    EAGER = 1
    #: An eager call before a capture (on the capture's side stream).
    WARM_UP = 2
    #: Capture a recording, then replay it once.
    CAPTURE = 3
    #: Replay a recording.
    REPLAY = 4


def ddp_modules(targets: StepTargets) -> list[tuple[str, torch.nn.Module]]:
    """The DDP modules among a step's modules (a compiled DDP's ``_orig_mod`` too)."""
    from torch.nn.parallel import DistributedDataParallel

    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in targets.modules:
        inner = getattr(module, "_orig_mod", None)
        for m in (module, inner):
            if isinstance(m, DistributedDataParallel):
                found.setdefault(id(m), (name, m))
    return list(found.values())


def fsdp2_modules(targets: StepTargets) -> list[tuple[str, torch.nn.Module]]:
    """The modules sharded with FSDP2's ``fully_shard`` among a step's modules and
    their submodules (a compiled module's ``_orig_mod`` too), with their names."""
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, root in targets.modules:
        for sub, m in root.named_modules(prefix=name):
            if compat.is_fsdp2_module(m):
                found.setdefault(id(m), (sub, m))
    return list(found.values())


def fsdp2_refusal(
    fsdps: Sequence[tuple[str, torch.nn.Module]], where: str
) -> StepUnsupported | None:
    """An FSDP2 setting a capture cannot hold, or ``None``."""
    for name, m in fsdps:
        if compat.fsdp2_offloads(m):
            return StepUnsupported(
                StepRefusalKind.DISTRIBUTED,
                where,
                f"{name} (FSDP2) offloads its parameters to the host (CPUOffloadPolicy): "
                "the optimizer steps them on the host, which a replay would not repeat",
                "shard without offload_policy to capture the step, or leave it uncaptured",
                op=f"fully_shard({name}, offload_policy=CPUOffloadPolicy())",
            )
        if compat.fsdp2_post_optim_event(m) is not None:
            return StepUnsupported(
                StepRefusalKind.DISTRIBUTED,
                where,
                f"{name} (FSDP2) has a post-optimizer event set "
                "(set_post_optim_event): it is recorded in one step and waited on by the "
                "next step's all-gathers, across the capture's end",
                "leave set_post_optim_event out of a captured step (the captured step "
                "orders its all-gathers after the optimizer itself)",
                op=f"{name}.set_post_optim_event(event)",
            )
    return None


def fsdp2_streams(fsdps: Sequence[tuple[str, torch.nn.Module]]) -> list[Any]:
    """The side streams FSDP2 made for these modules (each once), after their lazy init."""
    found: dict[int, Any] = {}
    for _, m in fsdps:
        for stream in compat.fsdp2_comm_streams(m):
            found.setdefault(id(stream), stream)
    return list(found.values())


def join_capturing(streams: Sequence[Any]) -> None:
    """Make the current stream wait on each of ``streams`` that is capturing now (it
    joined the capture through a wait on the capture stream): a capture must end with
    every stream it forked joined back. Streams that never joined are left alone (a
    capture may not wait on work outside it)."""
    if not streams or not torch.cuda.is_available():
        return
    current = torch.cuda.current_stream()
    if not torch.cuda.is_current_stream_capturing():
        return
    for stream in streams:
        with torch.cuda.stream(stream):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            current.wait_stream(stream)


#: What an FSDP2 step's capture needs that capture_step cannot set itself.
FSDP2_CAPTURE_HINT = (
    "for FSDP2 on NCCL, set TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment before "
    "init_process_group (NCCL's watchdog thread queries events while the capture runs); "
    "capture_step itself warms FSDP2 up for 2 calls and joins its streams into the capture"
)


def rehome_ddp_accumulators(
    targets: StepTargets, on_step_stream: Callable[[Callable[[], None]], Any]
) -> None:
    """Rebuild the reducer of each DDP on CUDA among ``targets`` through ``on_step_stream``
    (the capturer's ``warm_up``: the stream its warm-ups and captures run on), so that
    the ``AccumulateGrad`` nodes it keeps record that stream instead of the one DDP was
    built on (the default stream cannot join a capture). A DDP that ``torch.compile``
    wrapped has its wrappers' copies of the reducer replaced too. Before the first
    warm-up, on every rank (no collective)."""
    for name, ddp in ddp_modules(targets):
        device = next((p.device for p in ddp.parameters()), None)
        if device is None or device.type != "cuda":
            continue
        compiled = [m for _, m in targets.modules if getattr(m, "_orig_mod", None) is ddp]
        on_step_stream(functools.partial(compat.rebuild_ddp_reducer, ddp, compiled))
        log.debug(
            "capture_step: %s (DDP): reducer rebuilt on the capture stream (its "
            "AccumulateGrad nodes had the stream DDP was built on)",
            name,
        )


def quiet_ddp_timers(ddps: Sequence[tuple[str, torch.nn.Module]]) -> None:
    """Set each DDP's runtime-logging sample rate so that no iteration after its 10th
    reads the CUDA timers on the host (``_set_ddp_runtime_logging_sample_rate``)."""
    for name, ddp in ddps:
        compat.set_ddp_runtime_logging_sample_rate(ddp, DDP_SAMPLE_RATE)
        log.debug(
            "capture_step: %s (DDP): runtime logging sample rate set to %d", name, DDP_SAMPLE_RATE
        )


class RankAgreement:
    """The ranks of one process group agreeing on each call's :class:`Action`."""

    def __init__(self, group: Any, ranks: int) -> None:
        self.group = group
        self.ranks = ranks
        #: calls decided together (one all_reduce each)
        self.calls = 0

    def agree(self, proposal: int) -> int:
        """The minimum of every rank's ``proposal``."""
        self.calls += 1
        return compat.all_reduce_min(proposal, self.group)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a refusal's text: rare, so objects are fine)."""
        return compat.all_gather_object(value, self.group)


def rank_agreement(targets: StepTargets, setting: bool | None) -> RankAgreement | None:
    """The agreement a step's calls need, or ``None``: ``setting`` ``False`` never,
    ``True`` over the default group, ``None`` (auto) when the step uses a DDP or an
    FSDP2 module and torch.distributed runs more than one rank. Called on the first
    call of the step on every rank (it may create a gloo group: a collective call)."""
    if setting is False or not compat.distributed_initialized():
        return None
    ddps = ddp_modules(targets)
    group = getattr(ddps[0][1], "process_group", None) if ddps else None
    if setting is None and not ddps and not fsdp2_modules(targets):
        return None
    group, ranks = compat.host_group(group)
    if ranks < 2:
        return None
    return RankAgreement(group, ranks)
