"""The ``torchloom`` command line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchloom._cli import main


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["frobnicate"])
    assert err.value.code == 2
    assert "demo" in capsys.readouterr().err


@pytest.mark.inductor
@pytest.mark.fresh_processes
def test_demo_compiles_checks_against_eager_and_prints_a_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--device", "cpu", "--iters", "1", "--no-inductor"]) == 0
    out = capsys.readouterr().out
    assert "GPT train step" in out and "MLP inference" in out
    assert "loom compiled" in out


def test_demo_under_a_pipe_prints_one_line_per_stage_on_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchloom import _demo

    def fake_run_demo(*args: object, progress: Callable[[str], None], **kw: object) -> list[Any]:
        progress("loom: cold compile of every workload in a fresh process")
        progress("MLP inference: loom")
        times = {"eager": 1.0, "loom": 1.0}
        return [_demo.DemoResult("MLP inference", False, 0.0, True, times, times, times)]

    monkeypatch.setattr(_demo, "run_demo", fake_run_demo)
    assert main(["demo", "--device", "cpu", "--no-inductor"]) == 0  # capsys: not a terminal
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "loom: cold compile of every workload in a fresh process",
        "MLP inference: loom",
    ]
    assert all(line.startswith("[") and " s] " in line for line in lines)
    assert "MLP inference" in captured.out  # the table, on stdout


def test_help_lists_every_command_and_advertises_nothing_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "cache" in out and "--version" in out
    assert "torchloom report" not in out  # no command that does not exist


def test_version_names_every_loom_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--version"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "torchloom 0.1.0" in out and "torchloom-cache" in out


def _python(code: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, **kw
    )  # type: ignore[call-overload, no-any-return]


def test_help_and_version_import_no_torch(tmp_path: Path) -> None:
    # Start-up cost is what gets imported: --help/--version nothing heavy.
    for argv in (["--help"], ["--version"]):
        proc = _python(
            "import sys, contextlib, io\n"
            "from torchloom._cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main({argv!r})\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == "[]"


#: A process in which ``import torch`` fails, as on a machine without it.
_NO_TORCH = (
    "import importlib.abc, sys\n"
    "class NoTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.partition('.')[0] == 'torch':\n"
    "            raise ImportError(f'torch is blocked in this test ({name})')\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)


def test_cache_commands_that_read_the_store_never_import_torch(tmp_path: Path) -> None:
    """stats, list and clear read a directory's files: with torch's import blocked they
    still answer (issue 47: ``cache stats`` waited 98 s for torch on a loaded machine)."""
    from loom_cache import CacheKey, Entry, KeyComponent, LocalStore

    LocalStore(tmp_path).put(Entry(CacheKey("p", (KeyComponent("graph", "0" * 64, "g"),)), b"x"))
    proc = _python(
        _NO_TORCH + "from torchloom._cli import main\n"
        "for command in ('stats', 'list', 'clear'):\n"
        f"    assert main(['cache', '--dir', {str(tmp_path)!r}, command, "
        "*(['--yes'] if command == 'clear' else [])]) == 0, command\n"
        "print('torch' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    assert out[-1] == "False"
    assert any(line.startswith("entries") and line.split()[-1] == "1" for line in out), out
    assert any("removed 1 entr" in line for line in out), out


def test_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    from loom_cache import CacheKey, Entry, KeyComponent, LocalStore

    store = LocalStore(tmp_path)
    for i in range(3000):
        store.put(Entry(CacheKey("p", (KeyComponent("graph", f"{i:064x}", "g"),)), b"x"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchloom", "cache", "--dir", str(tmp_path), "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line, as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err and err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["cache", "--help"],
        *[["cache", sub, "--help"] for sub in ("stats", "list", "show", "explain", "clear")],
    ],
)
def test_help_is_plain_text_without_rst_markup(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "``" not in out and ":func:" not in out, out
