"""Why a training step is not captured as one CUDA graph, as typed data.

Refusals are decided at warm-up (before any capture), except a capture that
itself fails and a spent recording budget: those two are the capture core's own
kinds (``loom_cudagraph.CudagraphRefusalKind.CAPTURE_FAILED`` and ``RECORDING_BUDGET``),
shared with the per-graph runtime. Each names the op or object, the user's
``file:line`` and what to do instead; :class:`CaptureStepError` raises one
under ``or_error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib.util
import inspect
import linecache
import os
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from loom_cudagraph import CudagraphRefusalKind
from loom_sidefx import Refusal, RefusalError
from loom_step._targets import StepTargets

__all__ = [
    "CaptureStepError",
    "StepRefusalKind",
    "StepUnsupported",
    "autocast_refusal",
    "call_site",
    "capture_refusal",
    "collect_syncs",
    "describe_frame",
    "library_frame",
    "optimizer_refusals",
    "scaler_refusals",
    "sync_refusal",
    "user_frame",
]


class StepRefusalKind(enum.Enum):
    """Why a step runs uncaptured (every member is listed in docs/capture_step.md,
    beside the capture core's two kinds a step shares)."""

    #: No CUDA device, or the step's tensors are not on one: nothing to capture.
    NO_CUDA = "no_cuda"
    #: The step synchronizes with the host (``.item()``, ``.cpu()``, ``print(t)``).
    SYNC_OP = "sync_op"
    #: An optimizer whose step keeps host state (``capturable=False``, LBFGS, ...).
    OPTIMIZER_NOT_CAPTURABLE = "optimizer_not_capturable"
    #: An enabled ``GradScaler``: its inf check reads a device value on the host.
    GRAD_SCALER = "grad_scaler"
    #: The step is called under an autocast region whose cast cache outlives it.
    AUTOCAST_CACHE = "autocast_cache"
    #: A tensor argument is on the host: a replay reads device memory only.
    HOST_ARGUMENT = "host_argument"
    #: The step returns a Python value, which a replay cannot recompute.
    HOST_OUTPUT = "host_output"
    #: The step changes Python state a replay would not (a float lr, a rebound tensor).
    PYTHON_STATE = "python_state"
    #: A distributed engine's setting that a capture cannot hold (FSDP2's host
    #: offload, an event FSDP2 waits on in the next step).
    DISTRIBUTED = "distributed"


#: A step refusal's kind: the step's own, or the capture core's for a failed capture
#: (``CudagraphRefusalKind.CAPTURE_FAILED``) and a spent budget (``CudagraphRefusalKind.RECORDING_BUDGET``).
AnyStepRefusalKind = StepRefusalKind | CudagraphRefusalKind


@dataclasses.dataclass(frozen=True, slots=True)
class StepUnsupported(Refusal[AnyStepRefusalKind]):
    """What was refused, where (the user's ``file:line``), why, what to do instead
    (a ``loom_sidefx.Refusal``, formatted as every refusal is); ``op`` names the
    operation or its source line and leads the explanation."""

    op: str = ""
    #: Whether CUDA work runs uncaptured because of it (False on a host-only step).
    cuda_work: bool = True
    #: The library frame that did it, ``torch/nn/parallel/distributed.py:1566 in
    #: _pre_forward: self.logger.set_runtime_stats_and_log()`` (a host synchronization
    #: made inside torch, or the frame a failed capture raised in), or empty when the
    #: user's line did it itself.
    origin: str = ""

    def __str__(self) -> str:
        """The shared refusal text, ``[kind] where: op: explanation (hint: ...)``."""
        explanation = self.explanation
        if self.origin:
            verb = "synchronized" if self.kind is StepRefusalKind.SYNC_OP else "raised"
            explanation = f"{explanation} ({verb} in {self.origin})"
        if self.op:
            explanation = f"{self.op}: {explanation}"
        if explanation == self.explanation:
            return Refusal.__str__(self)
        return Refusal.__str__(dataclasses.replace(self, explanation=explanation, op=""))


class CaptureStepError(RefusalError, RuntimeError):
    """Raised under ``or_error`` (loom's ``cudagraph_or_error``) when a step would run uncaptured."""

    reason: StepUnsupported

    def __init__(self, reason: StepUnsupported, step: str = "") -> None:
        super().__init__(reason)
        where = f" {step}" if step else ""
        self.args = (
            f"cudagraph_or_error: capture_step{where} runs uncaptured: {reason}. "
            "Unset cudagraph_or_error (or TORCHLOOM_CUDAGRAPH_OR_ERROR) to run it uncaptured.",
        )


# --- where: the user's source line ----------------------------------------------------------


#: Packages whose frames are never the user's (looked up, not imported: the umbrella
#: calls in here, not the other way round).
_LIBRARIES = ("torch", "torchloom", "loom_cudagraph", "loom_step")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name)
        for d in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(str(Path(d).resolve()) + os.sep)
    return tuple(dirs)


#: Compile machinery: a synchronization from inside it is compile work (autotuning), not the step's.
_COMPILE_PARTS = (
    os.sep + "_inductor" + os.sep,
    os.sep + "_dynamo" + os.sep,
    os.sep + "_functorch" + os.sep,
    os.sep + "triton" + os.sep,
)


@functools.cache
def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Python's own library (``warnings``, ``contextlib``), and the package folders
    that may lie inside it (which are not)."""
    paths = sysconfig.get_paths()
    std = tuple(str(Path(paths[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib"))
    pkgs = tuple(str(Path(paths[k]).resolve()) + os.sep for k in ("purelib", "platlib"))
    return std, pkgs


def _is_library(filename: str) -> bool:
    if filename.startswith(_library_dirs()) or filename.startswith("<"):
        return True
    std, pkgs = _stdlib_dirs()
    return filename.startswith(std) and not filename.startswith(pkgs)


def user_frame(stack: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and loom (``stack`` is outermost first)."""
    for frame in reversed(stack):
        if not _is_library(str(Path(frame.filename).resolve())):
            return frame
    return None


#: Packages whose frames are loom's own machinery, never the origin of a step's sync.
_LOOM = ("torchloom", "loom_cudagraph", "loom_step")


def library_frame(stack: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of a library (torch, ...) below the user's innermost frame
    (``stack`` outermost first): the code that made the operation; ``None`` when the
    user's own line made it."""
    loom = tuple(d for d in _library_dirs() if Path(d).name in _LOOM)
    std, pkgs = _stdlib_dirs()
    for frame in reversed(stack):
        path = str(Path(frame.filename).resolve())
        if path.startswith(loom) or path.startswith("<"):
            continue
        if path.startswith(std) and not path.startswith(pkgs):
            continue  # warnings, contextlib
        return frame if _is_library(path) else None
    return None


def _short_path(filename: str) -> str:
    """A library file's path from its package folder (``torch/nn/parallel/distributed.py``)."""
    path = Path(filename).resolve()
    for root in (*_stdlib_dirs()[1], *(str(Path(d).parent) + os.sep for d in _library_dirs())):
        if str(path).startswith(root):
            return str(path)[len(root) :].replace(os.sep, "/")
    return str(path)


def describe_frame(frame: traceback.FrameSummary) -> str:
    """``path:line in function: source line`` of a library frame, the path from its package."""
    line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    where = f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"
    return f"{where}: {line}" if line else where


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def call_site(fn: Callable[..., Any], needle: str) -> str:
    """``file:line in fn`` of the first line of ``fn``'s source containing ``needle``
    (e.g. ``"opt.step("``), else of its ``def`` line."""
    target = inspect.unwrap(fn)
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is None:
        return ""
    try:
        lines, first = inspect.getsourcelines(target)
    except (OSError, TypeError):
        return f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}"
    for k, line in enumerate(lines):
        if needle and needle in line:
            return f"{code.co_filename}:{first + k} in {code.co_name}"
    return f"{code.co_filename}:{first} in {code.co_name}"


# --- the refusals ----------------------------------------------------------------------------

#: torch optimizers without a ``capturable`` flag whose step is nonetheless capturable.
_CAPTURABLE_WITHOUT_FLAG = (torch.optim.SGD,)


def optimizer_refusals(
    fn: Callable[..., Any], targets: StepTargets, device_type: str = "cuda"
) -> list[StepUnsupported]:
    """Optimizers whose ``step()`` keeps host state a replay would freeze."""
    out = []
    for name, opt in targets.optimizers:
        cls = type(opt).__name__
        where = call_site(fn, f"{name}.step(")
        on_device = any(p.device.type == device_type for g in opt.param_groups for p in g["params"])
        if not on_device:
            continue
        flags = [g.get("capturable") for g in opt.param_groups]
        if any(f is False for f in flags):
            out.append(
                StepUnsupported(
                    StepRefusalKind.OPTIMIZER_NOT_CAPTURABLE,
                    where,
                    f"{name} ({cls}) has capturable=False: its step counter lives on the host "
                    "and a replay would repeat the captured step number",
                    f"create it with {cls}(..., capturable=True)",
                    op=f"{name}.step()",
                )
            )
        elif all(f is None for f in flags) and not isinstance(opt, _CAPTURABLE_WITHOUT_FLAG):
            if type(opt).__module__.startswith("torch.optim"):
                out.append(
                    StepUnsupported(
                        StepRefusalKind.OPTIMIZER_NOT_CAPTURABLE,
                        where,
                        f"{name} ({cls}) has no capturable step",
                        "use SGD, or Adam/AdamW/... with capturable=True",
                        op=f"{name}.step()",
                    )
                )
    return out


def scaler_refusals(fn: Callable[..., Any], targets: StepTargets) -> list[StepUnsupported]:
    """An enabled ``GradScaler``: ``scaler.step`` reads the inf check on the host."""
    out = []
    for name, scaler in targets.scalers:
        if scaler.is_enabled():
            out.append(
                StepUnsupported(
                    StepRefusalKind.GRAD_SCALER,
                    call_site(fn, f"{name}.step("),
                    f"{name} (GradScaler) skips optimizer steps after a host-side inf check",
                    "train in bfloat16 autocast without a GradScaler, or leave this step uncaptured",
                    op=f"{name}.step()",
                )
            )
    return out


def autocast_refusal(fn: Callable[..., Any]) -> StepUnsupported | None:
    """The step is called under autocast with its cast cache on: the cached casts of
    the weights would outlive the step (and go stale when the optimizer updates them)."""
    if not torch.is_autocast_enabled("cuda") or not torch.is_autocast_cache_enabled():
        return None
    return StepUnsupported(
        StepRefusalKind.AUTOCAST_CACHE,
        call_site(fn, ""),
        "the step is called inside torch.autocast with cache_enabled=True",
        "enter autocast inside the step function, or pass cache_enabled=False",
        op="torch.autocast",
    )


def _frames_of(
    stack: Sequence[traceback.FrameSummary],
) -> tuple[traceback.FrameSummary | None, str, traceback.FrameSummary | None, str]:
    """The user's frame in ``stack`` and its source line, the library frame nearest the
    failure and its description (empty strings where there is none)."""
    frame = user_frame(stack)
    line = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    library = library_frame(stack)
    origin = describe_frame(library) if library is not None else ""
    return frame, line, library, origin


def sync_refusal(stack: Sequence[traceback.FrameSummary]) -> StepUnsupported | None:
    """A host synchronization seen at warm-up (``stack`` outermost first), or
    ``None`` when it came from compile machinery (autotuning)."""
    if any(part in frame.filename for frame in stack for part in _COMPILE_PARTS):
        return None
    frame, line, library, origin = _frames_of(stack)
    hint = (
        "keep .item(), .cpu(), .tolist() and printing of tensors out of the step; "
        "return the tensor and read it after the call"
    )
    if library is not None:
        hint = _LIBRARY_SYNC_HINTS.get(
            (_short_path(library.filename), library.name),
            f"the library synchronizes on the host here ({origin.split(': ')[0]}); "
            "configure it not to, or leave this step uncaptured",
        )
    return StepUnsupported(
        StepRefusalKind.SYNC_OP,
        _where(frame),
        "the step waits for the device on the host (a synchronizing CUDA operation); "
        "a replay cannot return a host value",
        hint,
        op=line,
        origin=origin,
    )


#: What to do about a host synchronization made by a known library function.
_LIBRARY_SYNC_HINTS = {
    ("torch/nn/parallel/distributed.py", "_pre_forward"): (
        "DDP reads its CUDA timers on the host for its first 10 iterations and every "
        "sample-rate-th after, and rebuilds its buckets after the first: capture_step warms "
        "a DDP step up for 11 iterations and sets ddp._set_ddp_runtime_logging_sample_rate "
        "itself; a DDP it did not find (pass track=[ddp_model]) or one called outside "
        "the step keeps syncing"
    ),
    **dict.fromkeys(
        (("torch/optim/sgd.py", "_multi_tensor_sgd"), ("torch/optim/sgd.py", "_single_tensor_sgd")),
        "torch's SGD reads a tensor lr on the host at every step (alpha=-lr): use a float "
        "lr with SGD (a replay reads it as recorded; keep it constant, or change it between "
        "recordings), or an optimizer with capturable=True, such as AdamW or Adam, whose "
        "tensor lr a replay reads on the device",
    ),
}


def capture_refusal(fn: Callable[..., Any], exc: BaseException, hint: str) -> StepUnsupported:
    """A capture that raised: the user's line the exception passed through (``where``
    and ``op``), the library frame that raised it (``origin``: the collective, the
    stream wait, ``torch.cuda.graph``'s end), and ``hint``, or a known frame's own."""
    frame, line, library, origin = _frames_of(traceback.extract_tb(exc.__traceback__))
    known = _LIBRARY_CAPTURE_HINTS.get(_short_path(library.filename)) if library else None
    if known is not None:
        hint = f"{known}; {hint}"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return StepUnsupported(
        CudagraphRefusalKind.CAPTURE_FAILED,
        _where(frame) or call_site(fn, ""),
        f"torch.cuda.graph capture raised {type(exc).__name__}: {message}",
        hint,
        op=line,
        origin=origin,
    )


#: What to do about a capture that failed in a known library file.
_LIBRARY_CAPTURE_HINTS = {
    "torch/cuda/graphs.py": (
        "the capture was invalidated before its end: CUDA work or a query outside the "
        "captured streams (another thread, such as NCCL's watchdog, or a stream the step "
        "forked and never joined); for NCCL set TORCH_NCCL_ASYNC_ERROR_HANDLING=0 before "
        "init_process_group, and report the op with TORCHLOOM_LOG=debug"
    ),
}


#: The text of the warning CUDA's sync debug mode gives for a synchronizing operation.
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def collect_syncs(found: list[StepUnsupported]) -> Iterator[None]:
    """Turn each sync warning issued in the block into a refusal naming the user's
    line (other warnings are shown as usual); see :func:`sync_refusal`."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def hook(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if SYNC_WARNING in str(message):
                reason = sync_refusal(traceback.extract_stack()[:-1])
                if reason is not None:
                    found.append(reason)
                return
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = hook
        yield
