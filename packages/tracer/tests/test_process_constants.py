"""Process constants (``_process_constants.py``): availability and device-count queries
are evaluated at trace time, recorded, and never traced into."""

from __future__ import annotations

from typing import Any

import torch

from loom_tracer import HookUnsupported, TracedHook, trace_hook
from loom_tracer._process_constants import PROCESS_CONSTANT_NAMES, process_constant_functions


def traced(fn: Any, *args: Any) -> TracedHook:
    result = trace_hook(fn, args)
    assert isinstance(result, TracedHook), str(result)
    return result


def test_torchs_own_pinned_save_on_cpu_pack_and_unpack_trace() -> None:
    """``save_on_cpu(pin_memory=True)`` calls ``torch.cuda.is_available()``, which reads
    ``os.environ``: traced into, the hook was refused (subscript of a _Environ)."""
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
    x = torch.randn(4, 6).t()  # non-contiguous, as attention's reshapes save
    pack = traced(hooks.pack_hook, x)
    assert pack.process_constants == (f"torch.cuda.is_available() -> {torch.cuda.is_available()}",)
    device, packed = pack.run(x)
    assert device == x.device and torch.equal(packed, x) and packed.is_contiguous()
    unpack = traced(hooks.unpack_hook, (device, packed))
    assert torch.equal(unpack.run((device, packed)), x)


def test_a_folded_call_decides_a_branch_without_a_guard_and_is_in_the_fingerprint() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return t.to(torch.bfloat16)
        return t * 2

    x = torch.randn(3)
    hook = traced(pack, x)
    assert hook.process_constants == (
        f"torch.cuda.is_available() -> {torch.cuda.is_available()}",
        *(
            (f"torch.cuda.device_count() -> {torch.cuda.device_count()}",)
            if torch.cuda.is_available()
            else ()
        ),
    )
    assert not any("is_available" in g.describe() for g in hook.guards)
    assert "process constant: torch.cuda.is_available()" in hook.describe()
    torch.testing.assert_close(hook.run(x), pack(x))

    def same_graph(t: torch.Tensor) -> torch.Tensor:  # the same code, nothing folded
        if True and 1 > 0:
            return t.to(torch.bfloat16)
        return t * 2

    assert traced(same_graph, x).fingerprint != hook.fingerprint


def test_a_device_module_reached_through_a_closure_is_folded_too() -> None:
    device_module = torch.cuda

    def pack(t: torch.Tensor) -> Any:
        return torch.empty(t.size(), dtype=t.dtype, pin_memory=device_module.is_available())

    assert traced(pack, torch.randn(2)).process_constants


def test_every_name_is_a_zero_argument_query_of_the_build_or_the_machine() -> None:
    found = process_constant_functions()
    assert "torch.cuda.is_available" in found.values()
    for fn, name in found.items():
        assert name.removeprefix("torch.") in PROCESS_CONSTANT_NAMES
        assert callable(fn) and isinstance(fn(), (bool, int))
    # what a program may change is left out: the current device, the default dtype
    assert torch.cuda.current_device not in found and torch.get_default_dtype not in found


def test_other_torch_cuda_calls_stay_refused() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return t

    result = trace_hook(pack, (torch.randn(2),))
    assert isinstance(result, HookUnsupported)
