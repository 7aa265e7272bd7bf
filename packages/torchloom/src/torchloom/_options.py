"""Typed, frozen options of the ``loom`` backend.

One :class:`LoomOptions` value describes a compilation. It is built from three
layers, later ones winning: the field defaults, environment variables
``TORCHLOOM_<FIELD>`` and the ``mode=`` / ``options=`` arguments that
``torch.compile`` passes to the backend. Every value is validated on the way in:
an unknown key, a wrong type or a number out of range raises
:class:`LoomOptionsError` naming the key and what is valid (the closest name for
a misspelt one). A ``TORCHLOOM_*`` variable that no part of torchloom reads warns
once with the closest name; ``cudagraphs=True`` on a machine without CUDA warns
once (graphs then run without CUDA graphs).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args, get_origin

__all__ = ["MODES", "LoomOptions", "LoomOptionsError", "resolve_options"]

Codegen = Literal["inductor", "eager"]


class LoomOptionsError(ValueError):
    """An option given to the ``loom`` backend was refused."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoomOptions:
    """Every knob of the ``loom`` backend. Settable by ``options={...}`` or env.

    Example::

        torch.compile(model, backend="loom", options={"codegen": "eager"})
        # or: TORCHLOOM_CODEGEN=eager python train.py
    """

    #: Per-graph code generator: Inductor (default) or the FX graph run eagerly.
    codegen: Codegen = "inductor"
    #: Raise instead of falling back to eager when a stage refuses a graph or hook.
    strict: bool = False
    #: Run graphs as CUDA graphs (``mode="reduce-overhead"`` sets this).
    cudagraphs: bool = False
    #: Raise when CUDA work would run outside a CUDA graph (env ``TORCHLOOM_CUDAGRAPH_OR_ERROR``).
    cudagraph_or_error: bool = False
    #: CUDA-graph recordings per segment and shape (a new one per static-input address set).
    cudagraph_max_recording: int = 5
    #: Captured segments with fewer work nodes run uncaptured (capture would not pay).
    cudagraph_min_segment_nodes: int = 1
    #: Distinct input shapes recorded per segment before new shapes run uncaptured.
    cudagraph_max_shapes: int = 8
    #: Capture functional collectives of NCCL process groups (and their waits) inside the
    #: CUDA graphs; False leaves every collective uncaptured, splitting the graph there.
    cudagraph_capture_collectives: bool = True
    #: Inductor's max-autotune (``mode="max-autotune"`` sets this).
    max_autotune: bool = False
    #: Place active ``saved_tensors_hooks`` inside compiled graphs (False: run them eagerly).
    saved_tensor_hooks_in_graph: bool = True
    #: What in-graph hooks pack: "all" saved tensors as eager does, or "activations" only.
    saved_tensor_hooks_scope: Literal["all", "activations"] = "all"
    #: Saved-tensor hook pairs, distinct by content, compiled into one frame's graphs;
    #: one more compilation runs every further pair's hooks eagerly.
    saved_tensor_hooks_variants: int = 4
    #: Lower in-graph hook pairs that move saved tensors to the host and back
    #: (``save_on_cpu``, ``.cpu()``, stream pairs) to overlapped copies (loom_offload).
    offload: bool = True
    #: Offloaded tensors smaller than this many bytes stay on the device.
    offload_min_bytes: int = 8 << 20
    #: Forward: offload copies in flight (bytes) before the compute stream waits for the
    #: oldest; the forward's last offloads within it stay on the device.
    offload_window_bytes: int = 256 << 20
    #: Backward: reloads started ahead of their first use, in bytes ...
    offload_prefetch_bytes: int = 512 << 20
    #: ... and in layers (``nn.ModuleList`` items).
    offload_prefetch_layers: int = 2
    #: Remove ``resize_(full) -> copy_ -> resize_(0)`` chains on FSDP-style parameters.
    resize_remove_chains: bool = True
    #: Reuse compiled graphs across processes through loom's cache (local store,
    #: plus Redis when ``TORCHLOOM_REMOTE_CACHE`` is set). ``TORCHLOOM_CACHE=0`` turns it off.
    cache: bool = True
    #: Under torch.distributed with more than one rank, agree across the ranks before
    #: serving a graph from the cache: every rank is served or every rank compiles
    #: (docs/distributed.md). ``TORCHLOOM_CACHE_AGREE=0`` turns it off.
    cache_agree: bool = True

    def changed(self, **updates: Any) -> LoomOptions:
        """A copy with ``updates`` applied and validated."""
        return resolve_options(options={**self.as_dict(), **updates}, env={})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


#: ``torch.compile(mode=...)`` values and the options each one stands for.
MODES: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
    {
        "default": {},
        "reduce-overhead": {"cudagraphs": True},
        "max-autotune-no-cudagraphs": {"max_autotune": True},
        "max-autotune": {"max_autotune": True, "cudagraphs": True},
    }
)

log = logging.getLogger("torchloom.options")

#: The least value of each integer option (``CudagraphOptions`` takes 0 for its
#: budgets; ``capture_step``'s own options are checked where they are resolved,
#: ``torchloom._capture_step``).
_MINIMUM: Final[Mapping[str, int]] = types.MappingProxyType(
    {
        "cudagraph_max_recording": 0,
        "cudagraph_min_segment_nodes": 0,
        "cudagraph_max_shapes": 0,
        "saved_tensor_hooks_variants": 0,
        "offload_min_bytes": 0,
        "offload_window_bytes": 0,
        "offload_prefetch_bytes": 0,
        "offload_prefetch_layers": 1,
    }
)
#: ``TORCHLOOM_*`` variables read outside the options (besides the cache's own).
_OTHER_VARIABLES: Final = (
    "TORCHLOOM_LOG",
    "TORCHLOOM_CHECKS",
    # capture_step's options (torchloom._capture_step resolves them)
    "TORCHLOOM_CAPTURE_STEP_WARMUP",
    "TORCHLOOM_CAPTURE_STEP_MAX_RECORDINGS",
)
_warned: set[str] = set()

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(LoomOptions)}


def _field_type(name: str) -> Any:
    return typing.get_type_hints(LoomOptions)[name]


def _describe_type(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _valid_keys() -> str:
    return ", ".join(f"{n} ({_describe_type(_field_type(n))})" for n in _fields())


def _closest(name: str, names: Any) -> str:
    """`` did you mean 'x'?`` for the closest of ``names``, or nothing."""
    close = difflib.get_close_matches(name, sorted(names), n=1)
    return f" did you mean {close[0]!r}?" if close else ""


def _check_value(name: str, value: Any, origin: str) -> Any:
    tp = _field_type(name)
    if get_origin(tp) is Literal:
        if value in get_args(tp):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            least = _MINIMUM.get(name)
            if least is not None and value < least:
                raise LoomOptionsError(
                    f"loom option {name!r} from {origin} got {value}; it must be at least {least}"
                )
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise LoomOptionsError(
        f"loom option {name!r} from {origin} got {value!r} ({type(value).__name__}); "
        f"expected {_describe_type(tp)}"
    )


def _parse_env(name: str, raw: str) -> Any:
    tp = _field_type(name)
    var = f"TORCHLOOM_{name.upper()}"
    if tp is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise LoomOptionsError(f"{var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise LoomOptionsError(f"{var}={raw!r}: expected an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise LoomOptionsError(f"{var}={raw!r}: expected a number") from None
    return raw.strip()


def resolve_options(
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> LoomOptions:
    """Build validated options: defaults < ``TORCHLOOM_*`` env < mode < options.

    >>> resolve_options(mode="reduce-overhead", env={}).cudagraphs
    True
    """
    env = os.environ if env is None else env
    fields = _fields()
    _warn_unknown_variables(env)
    values: dict[str, Any] = {}
    for name in fields:
        raw = env.get(f"TORCHLOOM_{name.upper()}")
        if raw is not None:
            values[name] = _check_value(name, _parse_env(name, raw), f"TORCHLOOM_{name.upper()}")
    if mode is not None:
        if mode not in MODES:
            raise LoomOptionsError(
                f"unknown torch.compile mode {mode!r} for backend 'loom'; "
                f"valid modes: {', '.join(MODES)}"
            )
        values.update(MODES[mode])
    for key, value in (options or {}).items():
        if key not in fields:
            raise LoomOptionsError(
                f"unknown loom option {key!r};{_closest(str(key), fields)} "
                f"valid options: {_valid_keys()}"
            )
        values[key] = _check_value(key, value, "options=")
    resolved = LoomOptions(**values)
    if resolved.cudagraphs:
        _warn_without_cuda()
    return resolved


def _known_variables() -> set[str]:
    from loom_cache import ENVIRONMENT_VARIABLES

    options = {f"TORCHLOOM_{name.upper()}" for name in _fields()}
    return options | set(ENVIRONMENT_VARIABLES) | set(_OTHER_VARIABLES)


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    """A ``TORCHLOOM_*`` variable nothing reads (a typo, say) warns once per name."""
    names = [n for n in env if n.startswith("TORCHLOOM_") and n not in _warned]
    if not names:
        return
    known = _known_variables()
    for name in names:
        _warned.add(name)
        if name not in known:
            log.warning(
                "torchloom: ignoring the environment variable %s: torchloom reads no such "
                "variable;%s",
                name,
                _closest(name, known) or " docs/torchloom.md lists the ones it reads",
            )


def _warn_without_cuda() -> None:
    """``cudagraphs=True`` where CUDA is not available: said once, never an error."""
    if "cudagraphs" in _warned:
        return
    import torch

    if not torch.cuda.is_available():
        _warned.add("cudagraphs")
        log.warning(
            "torchloom: cudagraphs=True (or mode='reduce-overhead') on a machine without "
            "CUDA: graphs run without CUDA graphs"
        )
