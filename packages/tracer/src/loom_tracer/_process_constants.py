"""Process constants: queries of the build and the machine, evaluated at trace time.

A call to one of these functions gives the same result for the whole life of
the process (whether a backend was compiled in, whether a device is there, how
many): the tracer evaluates it once, at trace time, bakes the result in as a
constant, and records ``name() -> result`` in ``TracedHook.process_constants``
and in the fingerprint, without a guard (a guard would re-read a value that
cannot change). Tracing into them would read process state (``os.environ``,
driver calls) that no trace can model. Dynamo folds the same kind of call
(``constant_fold_functions`` in ``torch/_dynamo/variables/torch.py``).

Left out on purpose: anything that reads the *current* device, stream or a mode
(``torch.cuda.current_device``, ``get_device_capability()`` of the current
device, ``torch.get_default_dtype``), which a program may change.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Dotted names under ``torch``; a name this torch lacks is skipped.
PROCESS_CONSTANT_NAMES: tuple[str, ...] = (
    "accelerator.is_available",
    "accelerator.device_count",
    "cpu.is_available",
    "cpu.device_count",
    "cuda.is_available",
    "cuda.device_count",
    "xpu.is_available",
    "xpu.device_count",
    "mps.is_available",
    "mps.device_count",
    "mtia.is_available",
    "mtia.device_count",
    "backends.cuda.is_built",
    "backends.cudnn.is_available",
    "backends.cusparselt.is_available",
    "backends.mkl.is_available",
    "backends.mkldnn.is_available",
    "backends.mps.is_available",
    "backends.mps.is_built",
    "backends.openmp.is_available",
    "distributed.is_available",
)


@functools.cache
def process_constant_functions() -> dict[object, str]:
    """The process-constant functions of this torch, by object, with their dotted names."""
    found: dict[object, str] = {}
    for name in PROCESS_CONSTANT_NAMES:
        obj: Any = torch
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if callable(obj) and not isinstance(obj, type):
            found[obj] = f"torch.{name}"
    return found


def process_constant_name(fn: object) -> str | None:
    """The dotted name of ``fn`` if it is a process constant, else ``None``."""
    try:
        return process_constant_functions().get(fn)
    except TypeError:  # unhashable
        return None


def describe_call(name: str, args: tuple[Any, ...], result: Any) -> str:
    """The text recorded for one folded call (stable across processes: constants only)."""
    return f"{name}({', '.join(repr(a) for a in args)}) -> {result!r}"
