"""The ``torchloom`` command line.

torchloom demo [--device cpu|cuda] [--iters N] [--no-inductor] [--report]
torchloom cache ...       (loom's compile cache: stats, list, show, explain, clear)
torchloom --version

Nothing heavy is imported before a command needs it (``--help`` and
``--version`` import no torch, nor do ``cache stats``, ``list`` and ``clear``), and a
closed pipe (``torchloom cache list | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Sequence

from torchloom._distributions import LOOM_DISTRIBUTIONS

__all__ = ["main"]

#: What ``torchloom --help`` says (plain text: the docstring above is for readers of
#: the source, and its RST markup would show as is).
_USAGE = """\
commands:
  torchloom demo [--device cpu|cuda] [--iters N] [--no-inductor] [--report]
  torchloom cache ...    loom's compile cache: stats, list, show, explain, clear
  torchloom --version
"""


def _progress_lines(start: float) -> Callable[[str], None]:
    """Where stdout is not a terminal (a pipe, CI), rich's spinner shows nothing for the
    demo's minutes: one line per stage on stderr instead, flushed, with the time so far."""

    def line(message: str) -> None:
        print(f"[{time.monotonic() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    return line


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import torchloom
    from torchloom._demo import run_demo

    console = Console(width=None if sys.stdout.isatty() else 160)
    torchloom.reset()
    run = functools.partial(run_demo, args.device, args.iters, inductor=not args.no_inductor)
    if sys.stdout.isatty():
        with console.status("starting") as status:
            results = run(progress=lambda msg: status.update(msg))
    else:
        results = run(progress=_progress_lines(time.monotonic()))
    names = list(results[0].median_ms)
    table = Table(
        title="torchloom demo: median step time (ms); first step = compile + step (s), "
        "cold and warm"
    )
    table.add_column("workload")
    for n in names:
        table.add_column(f"{n} ms", justify="right")
    if "inductor" in names:
        table.add_column("loom / inductor", justify="right")
    for n in names[1:]:
        table.add_column(f"{n} cold s", justify="right")
        table.add_column(f"{n} warm s", justify="right")
    table.add_column("matches eager", justify="center")
    for r in results:
        row = [r.workload] + [f"{r.median_ms[n]:.3f}" for n in names]
        if "inductor" in names:
            row.append(f"{r.median_ms['loom'] / r.median_ms['inductor']:.2f}x")
        for n in names[1:]:
            row += [f"{r.compile_s[n]:.1f}", f"{r.warm_s[n]:.1f}"]
        row.append(f"yes ({r.max_abs_diff:.1e})" if r.ok else f"[red]NO ({r.max_abs_diff:.1e})")
        table.add_row(*row)
    console.print(table)
    console.print(
        "First steps: each backend compiles every workload in a fresh process of its own, "
        "on empty cache directories of its own (cold), then in a second fresh process on "
        "those directories (warm); the first workload's also pays the process's imports."
    )
    rep = torchloom.report()
    fallbacks = sum(1 for g in rep if g.fallback)
    console.print(f"loom compiled {len(rep)} graphs ({fallbacks} ran eagerly).")
    if args.report:
        console.print(rep.format())
    return 0 if all(r.ok for r in results) else 1


def _version() -> str:
    parts = []
    for dist in LOOM_DISTRIBUTIONS:
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchloom",
        description="The torchloom command line: the loom backend's demo and its compile cache.",
        epilog=_USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="compile real models with loom, check and time them")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None)
    demo.add_argument("--iters", type=int, default=10)
    demo.add_argument("--no-inductor", action="store_true", help="skip the Inductor column")
    demo.add_argument("--report", action="store_true", help="print torchloom.report() after")
    sub.add_parser(
        "cache",
        help="loom's compile cache: stats, list, show, explain, clear (torchloom cache --help)",
        add_help=False,
    )
    return parser


def _run(args_list: list[str]) -> int:
    if args_list[:1] == ["cache"]:
        from torchloom._cli_cache import main as cache_main

        return cache_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(args.command)  # argparse refused anything else


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torchloom ARGV``; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _run(args_list)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): no traceback, and no second error when
        # the interpreter flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command a pipe ended
    return status


if __name__ == "__main__":
    sys.exit(main())
