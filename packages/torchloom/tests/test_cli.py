"""The ``torchloom`` command line."""

from __future__ import annotations

import pytest

from torchloom._cli import main


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["frobnicate"])
    assert err.value.code == 2
    assert "demo" in capsys.readouterr().err


@pytest.mark.inductor
def test_demo_compiles_checks_against_eager_and_prints_a_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--device", "cpu", "--iters", "1", "--no-inductor"]) == 0
    out = capsys.readouterr().out
    assert "GPT train step" in out and "MLP inference" in out
    assert "loom compiled" in out
