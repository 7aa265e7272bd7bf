"""Gradient hooks with a Python side effect on intermediate activations: step time.

An MLP of ``Linear(width, width)`` + GELU; a hook on every hidden activation
records the gradient's norm into a list created per step and clamps the
gradient (two hooks per activation). One training step (forward + backward)
per call, measured side by side:

- ``eager``: ``Tensor.register_hook`` in eager;
- ``inductor_register_hook``: ``register_hook`` under Inductor (Dynamo breaks
  the graph at each ``register_hook``; here the hooks are registered inside a
  loop, so Dynamo 2.11 "fails to handle the graph break gracefully" and runs
  the whole step eagerly: ``graphs`` (compiled graphs) is 0);
- ``loom_grad_hook``: ``torchloom.grad_hook`` under loom (one graph, the hooks
  as Python calls inside the compiled backward; the default, cache on);
- ``loom_grad_hook_inlined``: the same with ``cache`` off, where the hooks are
  traced and inlined into the compiled backward (``grad_hooks`` report entries).

``rel_err`` compares the recorded norms and the parameter gradients with eager.

    python benchmarks/bench_grad_hook.py --device cuda [--quick]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio, time_fn

import torchloom


def _mlp(width: int, layers: int, device: str) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers)).to(device)


def _clone_and_register(y: torch.Tensor, *fns: Callable[..., Any]) -> torch.Tensor:
    y = y.clone()
    for fn in fns:
        y.register_hook(fn)
    return y


def _make_step(hook: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def step(model: torch.nn.ModuleList, x: torch.Tensor, sink: list[torch.Tensor]) -> torch.Tensor:
        h = x
        for layer in model:
            h = torch.nn.functional.gelu(layer(h))

            def record(g: torch.Tensor) -> None:
                sink.append(g.norm())

            h = hook(h, record, lambda g: g.clamp(-1e-3, 1e-3))
        return h.square().mean()

    return step


def _train(step: Callable[..., torch.Tensor], model: torch.nn.ModuleList, x: torch.Tensor) -> Any:
    sink: list[torch.Tensor] = []
    model.zero_grad(set_to_none=False)
    step(model, x, sink).backward()
    return sink


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a.float() - b.float()).norm()) for a, b in zip(got, want, strict=True))
    den = sum(float(b.float().norm()) for b in want) or 1.0
    return num / den


def main() -> None:
    args = parse_args("grad hooks with Python side effects: step time")
    width, layers, batch = (256, 4, 64) if args.quick else (2048, 8, 512)
    device = args.device
    model = _mlp(width, layers, device)
    x = torch.randn(batch, width, device=device, requires_grad=True)
    counts: dict[str, int] = {}

    def counting(name: str, inner: Any) -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            if inner == "loom":
                return torchloom.loom_backend(gm, example_inputs, **kw)
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)

        return backend

    variants: dict[str, Callable[..., torch.Tensor]] = {
        "eager": _make_step(_clone_and_register),
        "inductor_register_hook": torch.compile(
            _make_step(_clone_and_register), backend=counting("inductor_register_hook", "inductor")
        ),
        "loom_grad_hook": torch.compile(
            _make_step(torchloom.grad_hook),
            backend=counting("loom_grad_hook", "loom"),
            fullgraph=True,
        ),
    }

    def loom_inlined(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        counts["loom_grad_hook_inlined"] = counts.get("loom_grad_hook_inlined", 0) + 1
        return torchloom.loom_backend(gm, example_inputs, options={"cache": False})

    variants["loom_grad_hook_inlined"] = torch.compile(
        _make_step(torchloom.grad_hook), backend=loom_inlined, fullgraph=True
    )

    reference_sink = _train(variants["eager"], model, x)
    reference_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rows: list[dict[str, Any]] = []
    for name, step in variants.items():
        torchloom.reset()
        sink = _train(step, model, x)  # compiles
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        entries = [e.kind for e in torchloom.report().entries("grad_hooks")]
        t = time_fn(lambda step=step: _train(step, model, x), iters=args.iters, device=device)
        rows.append(
            {
                "variant": name,
                "median_ms": t.median_ms,
                "graphs": counts.get(name, 0),
                "grad_hooks": ",".join(sorted(set(entries))) or "-",
                "records": len(sink),
                "rel_err": max(_rel_err(sink, reference_sink), _rel_err(grads, reference_grads)),
            }
        )
    eager_ms = rows[0]["median_ms"]
    for row in rows:
        row["vs_eager"] = ratio(row["median_ms"], eager_ms)
    print(format_table(rows))
    if not args.no_append:
        append_results(
            "grad_hook",
            f"grad hooks with a side effect, MLP {layers}x{width}, batch {batch}",
            rows,
            device=device,
        )


if __name__ == "__main__":
    main()
