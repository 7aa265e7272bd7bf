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

    assert cache_main(["--dir", str(tmp_path), "clear"], confirm=lambda q: False) == 1
    assert "nothing removed" in capsys.readouterr().out
    assert len(list(store.entries())) == 1
    assert cache_main(["--dir", str(tmp_path), "clear", "--yes"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert list(store.entries()) == []


def test_show_unknown_digest_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cache_main(["--dir", str(tmp_path), "show", "abc"]) == 1
    assert "no entry" in capsys.readouterr().out


def test_clear_asks_first_and_covers_the_remote_tier(
    tmp_path: Path, redis_server: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_cache import CacheConfig, RedisStore, open_default_store

    url = "redis://:pw-secret@" + redis_server.url.split("//", 1)[1]  # type: ignore[attr-defined]
    config = CacheConfig(
        tmp_path, keys=(b"fleet-key-0123456789abcdef",), namespace="team-a", remote_url=url
    )
    store = open_default_store(config)
    assert store.remote is not None
    store.put(Entry(_key(False), b"artifact"))
    other = RedisStore(url, config=CacheConfig(keys=config.keys, namespace="team-b"))
    other.put(Entry(_key(False), b"another tenant's"))
    questions: list[str] = []

    def refuse(question: str) -> bool:
        questions.append(question)
        return False

    assert cache_main(["clear"], config=config, confirm=refuse) == 1
    (question,) = questions
    assert "1 local entries" in question and "1 remote entries of namespace team-a" in question
    assert "pw-secret" not in question and "***" in question
    assert store.local.stats().entries == 1 and RedisStore(url, config=config).count() == 1
    capsys.readouterr()
    # Not a terminal and no --yes: nothing is removed.
    assert cache_main(["clear"], config=config) == 1
    assert "--yes" in capsys.readouterr().out
    assert cache_main(["clear", "--yes"], config=config) == 0
    out = capsys.readouterr().out
    assert "removed 1 entries from the remote tier" in out
    assert store.local.stats().entries == 0 and RedisStore(url, config=config).count() == 0
    assert other.count() == 1  # another namespace's entries stay


def test_stats_shows_signing_and_the_remote_tier_without_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loom_cache import CacheConfig

    config = CacheConfig(tmp_path, remote_url="redis://:pw-secret@127.0.0.1:1/0")
    assert cache_main(["stats"], config=config) == 0
    out = capsys.readouterr().out
    assert "signing    off (no key)" in out and "off (no key" in out
    assert "pw-secret" not in out
