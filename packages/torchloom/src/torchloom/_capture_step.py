"""``torchloom.capture_step``: ``loom_step.capture_step`` with loom's options and report.

The step's own options (``capture_step_warmup``, ``capture_step_max_recordings``)
are resolved here, once, from keyword arguments over ``TORCHLOOM_CAPTURE_STEP_*``
environment variables, into a ``loom_step.StepOptions``; ``cudagraph_or_error``
comes from loom's options. They are no backend option: no compiled graph reads
them, so they never enter a cache key. Each recording and refusal becomes an
entry of the step's record in :func:`torchloom.report`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import loom_step
from torchloom._options import LoomOptions, LoomOptionsError, resolve_options
from torchloom._report import GraphRecordBuilder, new_record

if TYPE_CHECKING:
    import loom_cudagraph

__all__ = ["STEP_OPTIONS", "capture_step", "resolve_step_options"]

P = ParamSpec("P")
R = TypeVar("R")

#: capture_step's own options, by their keyword (``TORCHLOOM_<KEYWORD>`` in the
#: environment), and the ``StepOptions`` field each sets.
STEP_OPTIONS: Mapping[str, str] = {
    "capture_step_warmup": "warmup",
    "capture_step_max_recordings": "max_recordings",
}


def _step_value(key: str, value: Any, origin: str) -> int:
    if isinstance(value, str) and origin != "options=":
        try:
            value = int(value)
        except ValueError:
            raise LoomOptionsError(f"{origin}={value!r}: expected an integer") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise LoomOptionsError(
            f"loom option {key!r} from {origin} got {value!r} ({type(value).__name__}); "
            "expected int"
        )
    if value < 1:
        raise LoomOptionsError(f"loom option {key!r} must be at least 1, got {value}")
    return value


def resolve_step_options(
    options: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[loom_step.StepOptions, LoomOptions]:
    """The step's options and loom's (for ``cudagraph_or_error`` and the report) from
    ``capture_step``'s keyword arguments over the environment."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for key, field in STEP_OPTIONS.items():
        var = f"TORCHLOOM_{key.upper()}"
        if key in options:
            values[field] = _step_value(key, options[key], "options=")
        elif var in env:
            values[field] = _step_value(key, env[var], var)
    rest = {k: v for k, v in options.items() if k not in STEP_OPTIONS}
    known = {f.name for f in dataclasses.fields(LoomOptions)}
    for key in rest:
        if key not in known:
            own = ", ".join(f"{k} (int)" for k in STEP_OPTIONS)
            raise LoomOptionsError(
                f"unknown capture_step option {key!r}; valid options: {own}, "
                f"and loom's options ({', '.join(sorted(known))})"
            )
    loom = resolve_options(options=rest, env=env)
    return loom_step.StepOptions(**values, or_error=loom.cudagraph_or_error), loom


class _ReportListener:
    """Each event of one step as an entry of its record (made on the first event)."""

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name = name
        self.options = dict(options)
        self.record: GraphRecordBuilder | None = None

    def __call__(self, event: loom_step.StepEvent) -> None:
        if self.record is None:
            self.record = new_record(f"capture_step {self.name}", (), self.options)
        data: dict[str, Any] = {}
        if event.refusal is not None:
            data = {"kind_": event.refusal.kind.value, "where": event.refusal.where}
        self.record.add_entry(
            "capture_step", event.kind, event.message, refusal=event.refusal, **data
        )


def capture_step(
    fn: Callable[P, R],
    /,
    *,
    track: Iterable[Any] = (),
    capturer: loom_cudagraph.Capturer | None = None,
    **options: Any,
) -> loom_step.CapturedStep[P, R]:
    """Capture a whole training step as one CUDA graph and replay it per call.

    ``fn`` does forward, loss, ``backward()``, ``optimizer.step()`` and
    ``zero_grad()``; its model may be compiled with ``backend="loom"`` or not.
    The modules, optimizers and tensors it uses are found from its closure and
    globals (``track=`` adds more). ``capturer`` is CUDA's by default
    (``loom_cudagraph.HostCapturer()`` runs the same path on the host, for tests).
    ``options``: ``capture_step_warmup``,
    ``capture_step_max_recordings`` and loom's ``cudagraph_or_error``, over
    ``TORCHLOOM_*`` environment variables. See ``loom_step.capture_step``.

    >>> opt = torch.optim.AdamW(model.parameters(), capturable=True)  # doctest: +SKIP
    >>> def train_step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> step = torchloom.capture_step(train_step)
    >>> for x, y in batches:
    ...     loss = step(x, y)          # warm-up, capture, then replays
    >>> print(step.stats().format())
    """
    step_options, loom = resolve_step_options(options)
    shown = {
        **loom.as_dict(),
        "capture_step_warmup": step_options.warmup,
        "capture_step_max_recordings": step_options.max_recordings,
    }
    name = getattr(fn, "__qualname__", repr(fn))
    return loom_step.capture_step(
        fn,
        track=track,
        options=step_options,
        capturer=capturer,
        listener=_ReportListener(name, shown),
    )
