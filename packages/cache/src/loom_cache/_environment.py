"""Key components for everything outside the graph that changes the result:
versions (torch, Triton, Python, loom_cache), the device kind and compute
capability, the Inductor and functorch configuration, numerics settings, and
the backend's identity and options.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys
from collections.abc import Mapping

import torch

from loom_cache import _torch_compat
from loom_cache._key import KeyComponent, mapping_component

__version__ = "0.1.0"


@functools.cache
def _dist_version(name: str) -> str:
    """An installed distribution's version, read once per process (a metadata scan)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def versions_component() -> KeyComponent:
    return mapping_component(
        "versions",
        {
            "torch": f"{torch.version.__version__}+{getattr(torch.version, 'git_version', '')}",
            "triton": _dist_version("triton"),
            "python": f"{platform.python_implementation()}-{platform.python_version()}",
            "bytecode": sys.implementation.cache_tag or "",
            "loom_cache": __version__,
        },
    )


def device_component(device: torch.device | str) -> KeyComponent:
    """Device kind, and for CUDA the name and compute capability of that GPU."""
    dev = torch.device(device)
    info: dict[str, object] = {"type": dev.type}
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
        info["name"] = torch.cuda.get_device_name(index)
        info["cuda"] = str(torch.version.cuda)
    return mapping_component("device", info)


def numerics_component() -> KeyComponent:
    """Global switches that change generated code or numerics."""
    return mapping_component(
        "numerics",
        {
            "default_dtype": str(torch.get_default_dtype()),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cuda_fp16_reduced_reduction": (
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            ),
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "grad_enabled": torch.is_grad_enabled(),
            "autocast_cpu": torch.is_autocast_enabled("cpu"),
            "autocast_cuda": torch.is_autocast_enabled("cuda"),
        },
    )


def config_components() -> tuple[KeyComponent, ...]:
    """The portable Inductor and functorch configuration (what Inductor keys on)."""
    return (
        mapping_component("inductor_config", _torch_compat.inductor_config()),
        mapping_component("functorch_config", _torch_compat.functorch_config()),
    )


def backend_component(name: str, version: str) -> KeyComponent:
    """The backend's identity: a program compiled by another backend never hits."""
    return mapping_component("backend", {"name": name, "version": version})


def options_component(options: Mapping[str, object]) -> KeyComponent:
    """The backend's options: a program compiled with other options never hits."""
    return mapping_component("options", options)


def environment_components(device: torch.device | str) -> tuple[KeyComponent, ...]:
    """All environment components for a graph compiled for ``device``."""
    return (
        versions_component(),
        device_component(device),
        numerics_component(),
        *config_components(),
    )
