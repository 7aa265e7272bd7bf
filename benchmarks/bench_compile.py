"""Compile cost of loom's own stages on a real model: a Hugging Face GPT-2
training step (built from a config, random weights), cold, in fresh processes.

Each variant runs in a fresh Python process that first imports what every
``torch.compile`` backend needs (Dynamo and AOTAutograd), then times
``import torchloom`` (loom variants only: the extra import is loom's cost) and
the first training step from ``torch.compile`` on (Dynamo trace, backend,
forward, backward). Inside the backend, ``torchloom.report()`` attributes every
timed section to loom or to PyTorch (AOTAutograd's trace, the partitioner,
codegen); a section's time excludes the sections nested in it. loom's share is
(import + loom's sections) / (import + first step).

Variants: the reference backend (``aot_eager`` on CPU, ``inductor`` on CUDA),
loom with the same codegen and the cache off, loom with an empty cache (key,
store), and loom with that cache warm (a hit).

    python benchmarks/bench_compile.py --device cpu --quick
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import append_results, format_table, parse_args, ratio

_CHILD = "--child"


def _child(variant: str, device: str, quick: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch._dynamo
    import torch._functorch.aot_autograd
    from transformers import GPT2Config, GPT2LMHeadModel

    loom = variant.startswith("loom")
    import_s = 0.0
    if loom:
        start = time.perf_counter()
        import torchloom

        import_s = time.perf_counter() - start
    dev = torch.device(device)
    small = quick or dev.type == "cpu"
    config = GPT2Config(
        n_layer=2 if small else 6,
        n_embd=64 if small else 512,
        n_head=4 if small else 8,
        vocab_size=128 if small else 8192,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(dev)
    ids = torch.randint(0, config.vocab_size, (2, 32 if small else 128), device=dev)
    codegen = "eager" if dev.type == "cpu" else "inductor"
    if loom:
        kwargs: dict[str, Any] = {
            "backend": "loom",
            "options": {"codegen": codegen, "cache": variant != "loom cache off"},
        }
    else:
        kwargs = {"backend": "aot_eager" if codegen == "eager" else "inductor"}
    start = time.perf_counter()
    compiled = torch.compile(model, **kwargs)
    compiled(input_ids=ids, labels=ids).loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    out: dict[str, Any] = {"first_step_s": first, "import_s": import_s}
    if loom:
        import torchloom

        rep = torchloom.report()
        sections: dict[str, float] = {}
        for g in rep:
            for s in g.stages:
                if s.owner == "loom":
                    sections[s.name] = sections.get(s.name, 0.0) + s.seconds
        out["loom_s"] = sum(g.loom_seconds for g in rep)
        out["backend_s"] = sum(g.compile_seconds for g in rep)
        out["sections"] = sections
        out["fallbacks"] = sum(g.fallback is not None for g in rep)
        cache = [e.kind for e in rep.entries("cache")]
        out["cache"] = f"{cache.count('hit')} hit / {cache.count('miss')} miss"
    print("RESULT " + json.dumps(out))


def _run(variant: str, device: str, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, _CHILD, variant, device, "1" if quick else "0"]
    base = {k: v for k, v in os.environ.items() if k != "TORCHLOOM_REMOTE_CACHE"}
    proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} child failed:\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def main() -> int:
    args = parse_args(
        __doc__.splitlines()[0],
        configure=lambda p: p.add_argument(
            "--repeats", type=int, default=None, help="rounds of every variant (median taken)"
        ),
    )
    repeats = args.repeats or (1 if args.quick else 3)
    reference = "aot_eager" if args.device == "cpu" else "inductor"
    variants = [reference, "loom cache off", "loom cold cache", "loom warm cache"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            # Rounds alternate the variants, so load on the machine hits all alike; each
            # round gets empty caches (loom's and Inductor's), warmed by its cold run.
            env = {
                "TORCHLOOM_CACHE_DIR": str(Path(tmp) / f"loom{r}"),
                "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor{r}"),
                "TRITON_CACHE_DIR": str(Path(tmp) / f"triton{r}"),
            }
            for variant in variants:
                runs[variant].append(_run(variant, args.device, args.quick, env))
                print(f"round {r + 1}/{repeats}: {variant} done", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    section_rows: list[dict[str, Any]] = []
    ref_first = median(r["first_step_s"] for r in runs[reference])
    for variant, results in runs.items():
        first = median(r["first_step_s"] + r["import_s"] for r in results)
        row: dict[str, Any] = {
            "variant": variant,
            "first step s (+ import)": round(first, 3),
            f"vs {reference}": ratio(first, ref_first),
        }
        if variant.startswith("loom"):
            own = median(r["loom_s"] + r["import_s"] for r in results)
            row["import torchloom s"] = round(median(r["import_s"] for r in results), 3)
            row["loom stages s"] = round(median(r["loom_s"] for r in results), 3)
            row["backend s"] = round(median(r["backend_s"] for r in results), 3)
            row["loom share"] = f"{100 * own / first:.1f} %"
            row["fallbacks"] = results[0]["fallbacks"]
            row["cache"] = results[0]["cache"]
            names = sorted({n for r in results for n in r["sections"]})
            top = sorted(
                ((median(r["sections"].get(n, 0.0) for r in results), n) for n in names),
                reverse=True,
            )[:6]
            section_rows.append({"variant": variant, **{n: f"{s * 1e3:.1f} ms" for s, n in top}})
        rows.append(row)
    print(format_table(rows))
    print()
    for sr in section_rows:
        print(format_table([sr]))
    if not args.no_append:
        size = "quick" if args.quick else "default"
        notes = (
            "GPT-2 training step built from a config (random weights); each variant in a "
            f"fresh process, median of {repeats} round(s). First step = torch.compile to the "
            "end of the first backward, plus `import torchloom` for loom (Dynamo and "
            "AOTAutograd imported before the timer for every variant). loom share = (import "
            "+ loom's own report sections) / that total; PyTorch's work inside the backend "
            "(AOTAutograd trace, partitioner, codegen) is not loom's."
        )
        append_results(
            "compile", f"compile cost ({args.device}, {size})", rows, notes, device=args.device
        )
        for sr in section_rows:
            append_results(
                "compile",
                f"largest loom sections, {sr['variant']} ({args.device}, {size})",
                [sr],
                device=args.device,
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        _child(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
        sys.exit(0)
    sys.exit(main())
