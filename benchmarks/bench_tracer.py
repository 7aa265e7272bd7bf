"""Hook tracer costs: trace time per hook and guard-check time per call (CPU).

Trace time is ``trace_hook`` on an already-built fake tensor (fake-tensor
setup excluded): interpretation, fake execution, lowering to aten with
``make_fx`` + functionalization, guard compilation and fingerprint. The
20-line hook is a realistic fp8 pack hook (closure counter, global config and
log, dtype/size branches, finfo scaling). Guard time is ``check_guards`` of a
hook with five guards against the same checks written by hand.

    python benchmarks/bench_tracer.py --device cpu
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio, time_fn

from loom_tracer import TracedHook, trace_hook
from loom_tracer._torch_compat import new_fake_mode

INNER = 1000  # guard calls per timed sample

CONFIG = {"fp8": True, "min_numel": 16, "margin": 0.9}
LOG: list[Any] = []


def make_pack20() -> Any:
    calls = 0
    amax_history: list[Any] = []

    def pack(t):  # 20 lines of hook body
        nonlocal calls
        calls += 1
        if t.dtype not in (torch.float32, torch.bfloat16):
            return ("raw", t)
        if t.numel() < CONFIG["min_numel"]:
            LOG.append(("small", tuple(t.shape)))
            return ("raw", t)
        fp8 = torch.float8_e4m3fn
        limit = torch.finfo(fp8).max * CONFIG["margin"]
        amax = t.abs().amax().clamp(min=1e-12)
        amax_history.append(amax)
        scale = limit / amax
        data = (t * scale).clamp(-limit, limit)
        if CONFIG["fp8"]:
            data = data.to(fp8)
        else:
            data = data.to(torch.bfloat16)
        LOG.append((f"{t.dtype}", tuple(t.shape), calls))
        packed = {"dtype": t.dtype, "data": data, "scale": scale}
        return ("fp8", packed)

    return pack


def pack3(t):
    return (t.dtype, t.to(torch.bfloat16))


def guarded5(t):
    if FLAG and MODE == "fp8" and t.numel() > THRESHOLD and SCALE > 0:
        return t * SCALE
    return t


FLAG = True
MODE = "fp8"
THRESHOLD = 4
SCALE = 2.0


def main() -> None:
    args = parse_args("hook tracer: trace time and guard checks")
    iters = args.iters or (5 if args.quick else 30)
    mode = new_fake_mode()
    with mode:
        fake = torch.empty(64, 128)
    real = torch.randn(64, 128)
    rows: list[dict[str, Any]] = []

    for name, make in (
        ("trace: 20-line fp8 pack hook", make_pack20),
        ("trace: 3-line pack hook", lambda: pack3),
    ):
        hook = make()
        first = trace_hook(hook, (fake,))
        assert isinstance(first, TracedHook), str(first)
        t = time_fn(
            lambda hook=hook: trace_hook(hook, (fake,)), warmup=2, iters=iters, device="cpu"
        )
        rows.append(
            {"variant": name, "ms": t.median_ms, "us_per_call": None, "guards": len(first.guards)}
        )

    traced = trace_hook(guarded5, (real,))
    assert isinstance(traced, TracedHook), str(traced)
    g = guarded5.__globals__

    def by_hand(t: torch.Tensor) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.dtype is torch.float32
            and t.shape == (64, 128)
            and t.stride() == (128, 1)
            and t.device == torch.device("cpu")
            and t.requires_grad is False
            and "FLAG" in g
            and g["FLAG"] is True
            and type(g["MODE"]) is str
            and g["MODE"] == "fp8"
            and type(g["THRESHOLD"]) is int
            and g["THRESHOLD"] == 4
            and type(g["SCALE"]) is float
            and g["SCALE"] == 2.0
        )

    assert traced.check_guards(real) and by_hand(real)

    def loop(fn: Any) -> Any:
        def run() -> None:
            for _ in range(INNER):
                fn(real)

        return run

    for name, fn in (
        (f"guards: check_guards ({len(traced.guards)} guards)", traced.check_guards),
        ("guards: by hand", by_hand),
    ):
        t = time_fn(loop(fn), warmup=3, iters=iters, device="cpu")
        rows.append(
            {
                "variant": name,
                "ms": None,
                "us_per_call": t.median_s / INNER * 1e6,
                "guards": len(traced.guards),
            }
        )
    rows[-2]["vs_by_hand"] = ratio(rows[-2]["us_per_call"], rows[-1]["us_per_call"])

    print(format_table(rows))
    print(traced.guard_source)
    if not args.no_append:
        append_results(
            "tracer",
            "Hook tracer: trace time per hook and guard checks per call (CPU)",
            rows,
            notes=(
                f"trace: median of {iters} traces, fake-tensor setup excluded; target under 50 ms "
                f"for a 20-line hook. guards: median of {iters} samples of {INNER} calls; target "
                "under 5 us for a hook with 5 guards."
            ),
            device="cpu",
        )


if __name__ == "__main__":
    main()
