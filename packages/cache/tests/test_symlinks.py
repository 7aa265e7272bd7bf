"""The store never leaves its directory: a symlink planted anywhere in its tree
(``v1``, ``v1/entries``, a shard, ``misses``, ``tmp``, a namespace's directory,
a file) is never followed, so no operation of ``LocalStore`` or of ``torchloom
cache`` reads, writes or deletes a file outside the store through it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom_cache import (
    CacheConfig,
    CacheKey,
    Entry,
    KeyComponent,
    LocalStore,
    cache_main,
    stable_digest,
)


def K(i: int) -> CacheKey:
    return CacheKey(f"x.py:f{i}", (KeyComponent("graph", stable_digest(i), f"g{i}"),))


def _files(top: Path) -> dict[str, bytes]:
    """Every file below ``top`` (not through a link) and its bytes."""
    out = {}
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            path = Path(dirpath) / name
            if not path.is_symlink():
                out[str(path.relative_to(top))] = path.read_bytes()
    return out


def test_clear_refuses_a_store_whose_directories_are_symlinks_out_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = LocalStore(tmp_path / "other")
    for i in range(3):
        assert other.put(Entry(K(i), b"another cache's")).stored
    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text("{}")
    (project / "config.json").write_text("{}")
    victim = LocalStore(tmp_path / "cache")
    victim.put(Entry(K(10), b"mine"))
    layout = tmp_path / "cache" / "v1"
    shutil.rmtree(layout / "entries")
    (layout / "entries").symlink_to(tmp_path / "other" / "v1" / "entries")
    shutil.rmtree(layout / "misses")
    (layout / "misses").symlink_to(project)
    before = {p: _files(tmp_path / p) for p in ("other", "project")}

    assert cache_main(["--dir", str(tmp_path / "cache"), "clear", "--yes"]) == 1
    out = capsys.readouterr().out
    assert "symlink" in out and "removed 3" not in out
    assert {p: _files(tmp_path / p) for p in ("other", "project")} == before
    assert LocalStore(tmp_path / "cache").clear() == 0  # the store refuses, not just the CLI
    assert {p: _files(tmp_path / p) for p in ("other", "project")} == before


# -- property: no operation leaves the store ---------------------------------------------

SHARD = K(1).digest[:2]
#: Where a symlink is planted (relative to the store's base, ``<dir>`` or ``<dir>/ns-team``)
#: and what it points at (relative to the outside folder: another cache, a project).
PLANTS = {
    "namespace": ("", "other"),
    "v1": ("v1", "other/v1"),
    "v1 -> project": ("v1", "project"),
    "entries": ("v1/entries", "other/v1/entries"),
    "entries -> project": ("v1/entries", "project"),
    "shard": (f"v1/entries/{SHARD}", f"other/v1/entries/{SHARD}"),
    "shard -> project": (f"v1/entries/{SHARD}", "project/ab"),
    "misses": ("v1/misses", "other/v1/misses"),
    "misses -> project": ("v1/misses", "project"),
    "tmp": ("v1/tmp", "other/v1/tmp"),
    "tmp -> project": ("v1/tmp", "project"),
    "entry file": (f"v1/entries/{SHARD}/{K(1).digest}.entry", "project/package.json"),
    "miss record": (f"v1/misses/{K(2).digest}.json", "project/config.json"),
    "lock": ("v1/lock", "project/lock"),
    "evict lock": ("v1/evict.lock", "project/lock"),
    "ledger": ("v1/ledger.json", "project/ledger.json"),
    "stats": ("v1/stats.json", "project/config.json"),
    "journal": ("v1/ledger.log", "project/hits.count"),
    "counter": ("v1/hits.count", "project/hits.count"),
    "index": ("v1/index.tsv", "project/index.tsv"),
}
_DEAD_TMP = f"x.entry.{os.uname().nodename}-99999999.{'0' * 32}.tmp"


def _outside(top: Path) -> None:
    """Another cache, and a project folder holding files named like the store's own."""
    other = LocalStore(top / "other")
    for i in range(4):
        other.put(Entry(K(i), b"another cache's"))
    other.record(hit=True)
    other.record_miss(K(2))
    project = top / "project"
    (project / "ab").mkdir(parents=True)
    for name in ("package.json", "config.json", "ledger.json", "index.tsv", "lock", "hits.count"):
        (project / name).write_text("precious\n")
    (project / "ab" / f"{'ab' * 32}.entry").write_bytes(b"precious")
    (project / f"{'cd' * 32}.entry").write_bytes(b"precious")
    for folder in (project, top / "other" / "v1" / "tmp"):
        for name in (_DEAD_TMP, "fold.t.hits", "fold.t.ledger"):
            (folder / name).write_text("1\n")
            old = time.time() - 7200
            os.utime(folder / name, (old, old))


def _snapshot(top: Path) -> dict[str, tuple[bytes, int]]:
    out = {}
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            path = Path(dirpath) / name
            if not path.is_symlink():
                out[str(path.relative_to(top))] = (path.read_bytes(), path.lstat().st_mtime_ns)
    return out


def _plant(base: Path, top: Path, plants: list[str]) -> None:
    # NOTE: deepest first: replacing v1 by a link must not put later links through it
    for where, target in sorted((PLANTS[p] for p in plants), key=lambda p: -len(p[0])):
        path = base / where if where else base
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(top / target, target_is_directory=(top / target).is_dir())


Op = Callable[[LocalStore, Path, CacheConfig], object]
OPS: dict[str, Op] = {
    "lookup": lambda s, r, c: (s.lookup(K(1).digest), s.lookup(K(2).digest)),
    "put": lambda s, r, c: [s.put(Entry(K(i), b"mine")) for i in (1, 2, 7)],
    "evict": lambda s, r, c: s.evict(0),
    "clear": lambda s, r, c: s.clear(),
    "record": lambda s, r, c: (s.record(hit=True), s.record(hit=False)),
    "record_miss": lambda s, r, c: s.record_miss(K(3)),
    "delete": lambda s, r, c: s.delete(K(1).digest),
    "read": lambda s, r, c: (
        s.stats(),
        s.summaries(),
        list(s.entries()),
        s.misses(),
        s.info(K(1).digest),
    ),
    "cli stats": lambda s, r, c: cache_main(["--dir", str(r), "stats"], config=c),
    "cli list": lambda s, r, c: cache_main(["--dir", str(r), "list"], config=c),
    "cli show": lambda s, r, c: cache_main(["--dir", str(r), "show", K(1).digest[:8]], config=c),
    "cli explain": lambda s, r, c: cache_main(["--dir", str(r), "explain"], config=c),
    "cli clear": lambda s, r, c: cache_main(["--dir", str(r), "clear", "--yes"], config=c),
}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    namespace=st.sampled_from(["", "team"]),
    plants=st.lists(st.sampled_from(sorted(PLANTS)), min_size=1, max_size=3, unique=True),
    ops=st.lists(st.tuples(st.sampled_from(sorted(OPS)), st.booleans()), min_size=1, max_size=6),
)
def test_no_operation_touches_a_file_outside_the_store_through_a_planted_symlink(
    namespace: str,
    plants: list[str],
    ops: list[tuple[str, bool]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not namespace:
        plants = [p for p in plants if p != "namespace"] or ["entries"]
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        _outside(top / "outside")
        root = top / "cache"
        config = CacheConfig(root, namespace=namespace)
        before_plant = LocalStore(config=config)  # opened before the links appear
        for i in (1, 2):
            before_plant.put(Entry(K(i), b"mine"))
        before_plant.record_miss(K(2))
        _plant(before_plant.base, top / "outside", plants)
        before = _snapshot(top / "outside")
        for name, fresh in ops:
            store = LocalStore(config=config) if fresh else before_plant
            with contextlib.suppress(SystemExit):
                OPS[name](store, root, config)
            assert _snapshot(top / "outside") == before, (name, plants)
        capsys.readouterr()
