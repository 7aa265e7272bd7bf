"""``torchloom cache``: look inside the cache (stats, list, show, explain, clear)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from loom_cache._key import CacheKey, explain_miss, nearest_key
from loom_cache._local import LocalStore
from loom_cache._store import EntryInfo


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchloom cache", description=__doc__)
    p.add_argument(
        "--dir", help="cache directory (default: TORCHLOOM_CACHE_DIR or ~/.cache/torchloom)"
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", help="entries, bytes and hit rate")
    sub.add_parser("list", help="one line per entry, most recently used first")
    show = sub.add_parser("show", help="an entry's key components")
    show.add_argument("digest", help="a digest or a unique prefix")
    explain = sub.add_parser(
        "explain", help="why a recorded miss missed: components that differ from the nearest entry"
    )
    explain.add_argument(
        "digest", nargs="?", help="a missed key's digest (default: the latest miss)"
    )
    sub.add_parser("clear", help="remove every entry")
    return p


def cache_main(argv: Sequence[str], store: LocalStore | None = None) -> int:
    """Run the ``torchloom cache`` command; returns the exit status."""
    args = _parser().parse_args(list(argv))
    store = store if store is not None else LocalStore(args.dir)
    if args.command == "stats":
        s = store.stats()
        print(f"directory  {store.root}")
        print(f"entries    {s.entries}")
        print(f"bytes      {s.bytes} (limit {s.max_bytes})")
        print(f"hits       {s.hits}")
        print(f"misses     {s.misses}")
        print(f"hit rate   {s.hit_rate:.1%}")
        print(f"corrupt    {s.corrupt}")
        return 0
    if args.command == "list":
        for info in sorted(store.entries(), key=lambda i: -i.last_used):
            print(_line(info))
        return 0
    if args.command == "show":
        found = _find(store, args.digest)
        if found is None:
            return 1
        print(f"digest   {found.digest}")
        print(f"program  {found.key.program}")
        print(f"size     {found.size} bytes")
        for k, v in found.meta:
            print(f"meta     {k} = {v}")
        for c in found.key.components:
            print(f"  {c.name:<18} {c.digest[:16]}  {_clip(c.detail)}")
        return 0
    if args.command == "explain":
        misses = store.misses()
        chosen: CacheKey | None = None
        for _, key in reversed(misses):
            if args.digest is None or key.digest.startswith(args.digest):
                chosen = key
                break
        if chosen is None:
            print("no recorded miss" + (f" matching {args.digest}" if args.digest else ""))
            return 1
        print(f"miss     {chosen.digest}  program {chosen.program}")
        candidates = [i.key for i in store.entries() if i.digest != chosen.digest]
        nearest = nearest_key(chosen, candidates)
        if nearest is None:
            print("the cache holds no other entry to compare with")
            return 0
        same = "same program" if nearest.program == chosen.program else "another program"
        print(f"nearest  {nearest.digest}  ({same}: {nearest.program})")
        for diff in explain_miss(chosen, nearest):
            print(f"  differs: {_clip(str(diff), 300)}")
        return 0
    if args.command == "clear":
        print(f"removed {store.clear()} entries")
        return 0
    raise AssertionError(args.command)


def _find(store: LocalStore, prefix: str) -> EntryInfo | None:
    found = [i for i in store.entries() if i.digest.startswith(prefix)]
    if len(found) != 1:
        print(
            f"{len(found)} entries match {prefix!r}; give a longer prefix"
            if found
            else f"no entry matches {prefix!r}"
        )
        return None
    return found[0]


def _line(info: EntryInfo) -> str:
    used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.last_used))
    return f"{info.digest[:16]}  {info.size:>10}  {used}  {info.key.program}"


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
