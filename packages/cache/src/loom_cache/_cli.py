"""``torchloom cache``: look inside the cache (stats, list, show, explain, clear)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from loom_cache._config import CacheConfig
from loom_cache._key import CacheKey, explain_miss, nearest_key
from loom_cache._local import LocalStore
from loom_cache._store import EntryInfo, StoreUnavailable
from loom_cache._tiered import TieredStore, open_store


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchloom cache",
        description="Look inside loom's compile cache: stats, list, show, explain, clear.",
    )
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
    clear = sub.add_parser(
        "clear",
        help="remove every entry, locally and on the remote tier (this namespace's); asks first",
    )
    clear.add_argument("-y", "--yes", action="store_true", help="do not ask")
    clear.add_argument(
        "--local-only", action="store_true", help="leave the remote tier's entries alone"
    )
    return p


def _ask(question: str) -> bool:
    if not sys.stdin.isatty():
        print(f"{question} -- not a terminal: pass --yes to confirm")
        return False
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def cache_main(
    argv: Sequence[str],
    store: LocalStore | TieredStore | None = None,
    *,
    config: CacheConfig | None = None,
    confirm: Callable[[str], bool] | None = None,
) -> int:
    """Run the ``torchloom cache`` command; returns the exit status.

    The store is the one ``config`` describes (default: the environment, as
    ``CacheConfig.from_env()`` resolves it), with ``--dir`` replacing its directory;
    ``confirm`` answers ``clear``'s question (default: ask on the terminal). No
    command creates the directory."""
    args = _parser().parse_args(list(argv))
    if store is None:
        config = config if config is not None else CacheConfig.from_env()
        if args.dir:
            config = dataclasses.replace(config, dir=Path(args.dir))
        store = open_store(config, create=False)
    tiered = store if isinstance(store, TieredStore) else TieredStore(store)
    local = tiered.local
    if args.command == "clear":
        return _clear(tiered, args.yes, args.local_only, confirm or _ask)
    return _inspect(local, tiered, args)


def _clear(store: TieredStore, yes: bool, local_only: bool, confirm: Callable[[str], bool]) -> int:
    local = store.local
    namespace = local.config.namespace or "(no namespace)"
    status = 0
    parts = []
    if local.off is None:
        parts.append(
            f"{local.stats().entries} local entries of namespace {namespace} in {local.base}"
        )
    else:
        print(f"the local tier is refused, so nothing is removed from it: {local.off}")
        status = 1
    remote = None if local_only else store.remote
    if remote is not None:
        target = local.config.remote_url_redacted or remote.name
        try:
            count = getattr(remote, "count", None)
            n_remote = f"{count()} " if count is not None else ""
        except StoreUnavailable as exc:
            print(f"the remote tier failed, so only the local tier is cleared: {exc}")
            remote, status = None, 1
        else:
            parts.append(f"{n_remote}remote entries of namespace {namespace} on {target}")
    if not parts:
        return status
    if not yes and not confirm(f"remove {' and '.join(parts)}?"):
        print("nothing removed")
        return 1
    if local.off is None:
        removed = local.clear()
        if local.off is not None:
            print(f"refused to clear {local.base}: {local.off}")
            status = 1
        else:
            print(f"removed {removed} entries from {local.base}")
    if remote is not None:
        try:
            print(f"removed {remote.clear()} entries from the remote tier")
        except StoreUnavailable as exc:
            print(f"could not clear the remote tier: {exc}")
            return 1
    return status


def _inspect(local: LocalStore, tiered: TieredStore, args: argparse.Namespace) -> int:
    store = local
    if args.command == "stats":
        s = store.stats()
        print(f"directory  {store.root}" + (f"  (off: {store.off})" if store.off else ""))
        if store.config.namespace:
            print(f"namespace  {store.config.namespace} (local entries under {store.base})")
        print(f"entries    {s.entries}")
        print(f"bytes      {s.bytes} (limit {s.max_bytes})")
        print(f"hits       {s.hits}")
        print(f"misses     {s.misses}")
        print(f"hit rate   {s.hit_rate:.1%}")
        print(f"corrupt    {s.corrupt}")
        config = store.config
        signing = "keys " + ", ".join(config.key_ids) if config.keys else "off (no key)"
        if config.key_missing is not None:
            signing = f"refusing every entry (fail closed): {config.key_missing}"
        print(f"signing    {signing}")
        remote = config.remote_url_redacted
        if remote is None:
            print("remote     off")
        else:
            off = tiered.remote_off or "not opened by this command"
            state = "on" if tiered.remote is not None else f"off: {off}"
            print(
                f"remote     {remote} ({state}, trust {config.remote_trust}, "
                f"reads up to {config.remote_max_bytes} bytes)"
            )
        return 0
    if args.command == "list":
        for info in sorted(store.summaries(), key=lambda i: -i.last_used):
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.last_used))
            print(f"{info.digest[:16]}  {info.size:>10}  {used}  {info.program}")
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
    raise AssertionError(args.command)


def _find(store: LocalStore, prefix: str) -> EntryInfo | None:
    found = [s.digest for s in store.summaries() if s.digest.startswith(prefix)]
    info = store.info(found[0]) if len(found) == 1 else None
    if info is None:
        print(
            f"{len(found)} entries match {prefix!r}; give a longer prefix"
            if found
            else f"no entry matches {prefix!r}"
        )
    return info


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
