"""``torchloom cache`` subcommands on a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom_cache import Entry, LocalStore, cache_main, graph_fingerprint, make_key


def _key(cudagraphs: bool):  # type: ignore[no-untyped-def]
    fp = graph_fingerprint(torch.fx.symbolic_trace(lambda x: x * 2))
    return make_key(
        "model.py:3:forward#0",
        fp,
        device="cpu",
        backend=("loom", "0.1.0"),
        options={"cudagraphs": cudagraphs},
    )


def test_stats_list_show_explain_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path)
    stored = _key(False)
    store.put(Entry(stored, b"artifact"))
    store.record(hit=True)
    missed = _key(True)
    store.record(hit=False)
    store.record_miss(missed)

    assert cache_main(["--dir", str(tmp_path), "stats"]) == 0
    out = capsys.readouterr().out
    assert "entries    1" in out and "hit rate   50.0%" in out

    assert cache_main(["--dir", str(tmp_path), "list"]) == 0
    assert stored.digest[:16] in capsys.readouterr().out

    assert cache_main(["--dir", str(tmp_path), "show", stored.digest[:10]]) == 0
    out = capsys.readouterr().out
    assert "model.py:3:forward#0" in out and "inductor_config" in out

    assert cache_main(["--dir", str(tmp_path), "explain"]) == 0
    out = capsys.readouterr().out
    assert "same program" in out and "cudagraphs: False -> True" in out

    assert cache_main(["--dir", str(tmp_path), "clear"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert list(store.entries()) == []


def test_show_unknown_digest_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cache_main(["--dir", str(tmp_path), "show", "abc"]) == 1
    assert "no entry" in capsys.readouterr().out
