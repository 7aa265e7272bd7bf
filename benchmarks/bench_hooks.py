"""Saved-tensor hooks inside compiled graphs: peak memory and step time.

A 12-layer MLP of ``Linear(4096, 4096)`` + GELU at a batch where activations
dominate, one training step (forward + backward) per call, measured side by
side: eager without hooks, eager with fp8 hooks (``float8_e4m3fn`` with a
per-tensor scale), Inductor without hooks, Inductor with the same Python hooks
(PyTorch runs them after the forward on every saved tensor), Inductor with the
hooks as ``GraphModule``s (PyTorch's own inlining, intermediates only), and
loom with them (Python hooks traced and placed after each tensor's last use;
scope ``all`` as eager, and ``activations``). Then CPU offload hooks: eager
against loom, with the gradients zeroed in place (``p.grad.zero_()``, as
above) and set to ``None`` (``zero_grad()``'s default: the step's gradients
then count in the peak). ``peak_gib`` is the peak CUDA memory of a step above
what the parameters and gradients hold; ``fwd_peak_gib`` and ``bwd_peak_gib``
split it into the forward call and the backward call; ``grad_rel_err``
compares gradients with eager running the same hooks.

With ``--diag`` it also prints, for each loom variant, the Inductor output code
files it ran and, for offloaded graphs, the order of the backward's
host-to-device copies among its kernel launches.

    python benchmarks/bench_hooks.py --device cuda [--quick] [--diag]
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, peak_memory, ratio, time_fn

import torchloom  # noqa: F401  (registers the loom backend)

FP8_MAX = 448.0
GIB = 2**30


# -- hooks ----------------------------------------------------------------------------


def fp8_pack(t: torch.Tensor) -> Any:
    scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (t.dtype, (t / scale).to(torch.float8_e4m3fn), scale)


def fp8_unpack(p: Any) -> torch.Tensor:
    dtype, q, scale = p
    return (q.to(torch.float32) * scale).to(dtype)


class Fp8Pack(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> Any:
        scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
        return (t.dtype, (t / scale).to(torch.float8_e4m3fn), scale)


class Fp8Unpack(torch.nn.Module):
    def forward(self, p: Any) -> torch.Tensor:
        dtype, q, scale = p
        return (q.to(torch.float32) * scale).to(dtype)


def offload_pack(t: torch.Tensor) -> Any:
    return (t.device, t.to("cpu"))


def offload_unpack(p: Any) -> torch.Tensor:
    return p[1].to(p[0])


PY_FP8 = (fp8_pack, fp8_unpack)
GM_FP8 = (torch.fx.symbolic_trace(Fp8Pack()), torch.fx.symbolic_trace(Fp8Unpack()))
OFFLOAD = (offload_pack, offload_unpack)


# -- workload -------------------------------------------------------------------------


def make_model(width: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device)


@contextlib.contextmanager
def hooks_active(hooks: Any) -> Iterator[None]:
    if hooks is None:
        yield
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield


def make_step(
    fn: Callable[..., Any],
    model: torch.nn.Module,
    x: torch.Tensor,
    hooks: Any,
    grads_to_none: bool = False,
) -> Any:
    def step() -> None:
        for p in model.parameters():
            if grads_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        with hooks_active(hooks):
            out = fn(x)
        out.square().mean().backward()

    return step


def split_peaks(
    fn: Callable[..., Any], model: torch.nn.Module, x: torch.Tensor, hooks: Any, grads_to_none: bool
) -> tuple[float, float]:
    """Peak GiB of the forward call and of the backward call, each above what was allocated
    when it started (the backward's start holds the forward's output and saved values)."""
    for p in model.parameters():
        if grads_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    keep: list[Any] = []

    def forward() -> None:
        with hooks_active(hooks):
            keep.append(fn(x))

    fwd = peak_memory(forward, "cuda") or 0
    loss = keep.pop().square().mean()
    bwd = peak_memory(loss.backward, "cuda") or 0
    return fwd / GIB, bwd / GIB


def inductor_modules() -> list[Any]:
    from torch._inductor.codecache import PyCodeCache

    return list(PyCodeCache.modules)


def describe_copies(path: str) -> str:
    """The order of host-to-device copies of packed values among a wrapper's launches."""
    text = Path(path).read_text()
    calls = text[text.find("def call(") :]
    events: list[str] = []
    for line in calls.splitlines():
        copy = re.search(r"\.copy_\((\w+_packed_\d+)", line)
        if copy:
            events.append(f"H2D({copy.group(1)})")
        elif re.search(r"\.run\(|extern_kernels\.|aten\.", line):
            events.append("k")
    # NOTE: compress runs of kernels: "k x3 H2D(a) k H2D(b)" reads as the schedule.
    runs: list[list[Any]] = []
    for event in events:
        if runs and event == "k" and runs[-1][0] == "k":
            runs[-1][1] += 1
        else:
            runs.append([event, 1])
    return " ".join(e if e != "k" else f"k{n}" for e, n in runs)


def grads_after_one_step(step: Callable[[], None], model: torch.nn.Module) -> list[torch.Tensor]:
    step()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a.float() - b.float()).norm() ** 2) for a, b in zip(got, want, strict=True))
    den = sum(float(b.float().norm() ** 2) for b in want)
    return (num / max(den, 1e-30)) ** 0.5


def compiled(model: torch.nn.Module, kind: str, options: dict[str, Any] | None = None) -> Any:
    torch._dynamo.reset()
    if kind == "eager":
        return model
    if kind == "inductor":
        return torch.compile(model, backend="inductor")
    return torch.compile(model, backend="loom", options=options or {})


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        configure=lambda p: p.add_argument(
            "--diag",
            action="store_true",
            help="print the Inductor output code of loom variants and the offload copy order",
        ),
    )
    device = args.device
    cuda = device == "cuda"
    width, layers, batch = (4096, 12, 8192) if cuda and not args.quick else (256, 4, 512)
    model = make_model(width, layers, device)
    x = torch.randn(batch, width, device=device)
    loom_codegen = {} if cuda else {"codegen": "eager"}
    variants: list[tuple[str, str, Any, dict[str, Any] | None]] = [
        ("eager", "eager", None, None),
        ("eager + fp8 hooks", "eager", PY_FP8, None),
        ("loom", "loom", None, loom_codegen),
        ("loom + fp8 Python hooks (all)", "loom", PY_FP8, loom_codegen),
        (
            "loom + fp8 Python hooks (activations)",
            "loom",
            PY_FP8,
            {**loom_codegen, "saved_tensor_hooks_scope": "activations"},
        ),
        (
            "loom + fp8 GraphModule hooks (activations)",
            "loom",
            GM_FP8,
            {**loom_codegen, "saved_tensor_hooks_scope": "activations"},
        ),
        ("eager + offload hooks", "eager", OFFLOAD, None),
        ("loom + offload hooks", "loom", OFFLOAD, loom_codegen),
        # NOTE: zero_grad()'s default: AccumulateGrad takes each new gradient as it is,
        # where zeroed gradients make eager add and free one at a time while a compiled
        # backward returns all of its gradients at once.
        ("eager + offload hooks, grads None", "eager", OFFLOAD, None),
        ("loom + offload hooks, grads None", "loom", OFFLOAD, loom_codegen),
    ]
    if cuda:
        variants[2:2] = [
            ("inductor", "inductor", None, None),
            ("inductor + fp8 Python hooks", "inductor", PY_FP8, None),
            ("inductor + fp8 GraphModule hooks (native)", "inductor", GM_FP8, None),
        ]
    reference: dict[int, list[torch.Tensor]] = {}
    rows: list[dict[str, Any]] = []
    for name, kind, hooks, options in variants:
        fn = compiled(model, kind, options)
        to_none = name.endswith("grads None")
        step = make_step(fn, model, x, hooks, grads_to_none=to_none)
        before = {id(m) for m in inductor_modules()} if args.diag else set()
        grads = grads_after_one_step(step, model)  # compiles; allocates the gradients
        key = id(hooks[0]) if hooks is not None else 0
        if kind == "eager":
            reference.setdefault(key if hooks is not GM_FP8 else id(fp8_pack), grads)
        want = reference.get(id(fp8_pack) if hooks is GM_FP8 else key)
        peak = peak_memory(step, device)
        fwd_peak, bwd_peak = split_peaks(fn, model, x, hooks, to_none) if cuda else (None, None)
        # NOTE: a step is ~0.2 s on an H100 at full size (offload: ~4 s, pageable copies);
        # 10 steps (3 offloaded) keep the run short.
        iters = min(args.iters, 3 if hooks is OFFLOAD and cuda and not args.quick else 10)
        timing = time_fn(step, warmup=1, iters=iters, device=device)
        if args.diag and kind == "loom":
            for module in inductor_modules():
                if id(module) not in before and getattr(module, "__file__", None):
                    print(f"[diag] {name}: Inductor output code {module.__file__}")
                    if hooks is OFFLOAD:
                        print(f"[diag]   {describe_copies(module.__file__)}")
        rows.append(
            {
                "variant": name,
                "peak_gib": None if peak is None else peak / GIB,
                "fwd_peak_gib": fwd_peak,
                "bwd_peak_gib": bwd_peak,
                "median_ms": timing.median_s * 1e3,
                "grad_rel_err": None if want is None or kind == "eager" else rel_err(grads, want),
            }
        )
        del fn, step
    base = next((r for r in rows if r["variant"] == "inductor"), rows[0])
    for row in rows:
        row["peak_vs_inductor"] = ratio(row["peak_gib"], base["peak_gib"])
        row["step_vs_inductor"] = ratio(row["median_ms"], base["median_ms"])
    print(format_table(rows))
    notes = (
        f"{layers} x (Linear({width}, {width}) + GELU), batch {batch}, fp32; one step = "
        "forward + backward; peak above parameters and gradients (fwd/bwd: the forward "
        "call, the backward call, each above what was live when it started; 'grads None': "
        "gradients set to None before each step, so they count in the peak). Ratios are to "
        f"{base['variant']} without hooks. grad_rel_err: relative L2 error of the gradients "
        "against eager with the same hooks."
    )
    if not args.no_append:
        append_results("hooks", "Saved-tensor hooks in compiled graphs", rows, notes, device=device)


if __name__ == "__main__":
    main()
