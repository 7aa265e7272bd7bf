"""The embedded local store: one file per entry under the user cache directory.

Invariants: readers never see a partial entry (writes go to a temporary file
in the same directory tree and are published with ``os.replace``); a crash
mid-write leaves only a temporary file that later sweeps remove; the total
size stays under ``max_bytes`` by evicting least-recently-used entries (a hit
refreshes the entry's mtime); corrupt entries are removed and reported. A directory the process cannot
use (unwritable, an uncreatable parent, a regular file in its place) never
raises out of the store: lookups miss and puts return a :class:`PutResult`
saying why, with one warning; a directory removed while the process runs is
recreated by the next put.
Only eviction and the hit/miss counters take a lock (``fcntl.flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from loom_cache._config import max_bytes_from_env
from loom_cache._entry import (
    MAGIC,
    Entry,
    EntryError,
    decode_entry,
    decode_header,
    encode_entry,
)
from loom_cache._key import CacheKey
from loom_cache._store import EntryInfo, Lookup, PutResult, StoreStats

log = logging.getLogger("torchloom.cache")

LAYOUT: Final = "v1"
_STALE_TMP_SECONDS: Final = 3600.0
_MAX_MISS_RECORDS: Final = 200


def default_cache_dir() -> Path:
    """``TORCHLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/torchloom``, else ``~/.cache/torchloom``."""
    explicit = os.environ.get("TORCHLOOM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchloom"


class LocalStore:
    """A directory of entries, safe with several processes writing at once.

    >>> import tempfile
    >>> store = LocalStore(tempfile.mkdtemp())
    >>> store.lookup("0" * 64).reason
    'absent'
    """

    name = "local"

    def __init__(self, root: str | os.PathLike[str] | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.max_bytes = max_bytes if max_bytes is not None else max_bytes_from_env()
        self._dir = self.root / LAYOUT
        self._entries = self._dir / "entries"
        self._tmp = self._dir / "tmp"
        self._misses = self._dir / "misses"
        self._warned = False
        with contextlib.suppress(OSError):  # reported by the first put that needs them
            self._make_dirs()

    def _make_dirs(self) -> None:
        for d in (self._entries, self._tmp, self._misses):
            d.mkdir(parents=True, exist_ok=True)

    def _not_stored(self, reason: str) -> PutResult:
        if not self._warned:
            self._warned = True
            log.warning("loom cache: the local tier stores nothing: %s", reason)
        else:
            log.debug("loom cache: not stored: %s", reason)
        return PutResult(False, self.name, reason)

    # -- entries -----------------------------------------------------------
    def path_of(self, digest: str) -> Path:
        return self._entries / digest[:2] / f"{digest}.entry"

    def lookup(self, digest: str) -> Lookup:
        path = self.path_of(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return Lookup(None, self.name, "absent")
        except NotADirectoryError:
            return Lookup(None, self.name, f"absent (the cache directory {self.root} is unusable)")
        except OSError as exc:
            return Lookup(None, self.name, f"unreadable: {exc}")
        try:
            entry = decode_entry(data, expected_digest=digest)
        except EntryError as exc:
            log.warning("loom cache: dropping entry %s: %s", digest[:12], exc)
            with contextlib.suppress(OSError):
                path.unlink()
            self._bump("corrupt")
            return Lookup(None, self.name, f"corrupt entry: {exc}")
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU: a hit is a use
        return Lookup(entry, self.name, "hit")

    def put(self, entry: Entry) -> PutResult:
        """Store ``entry``; a local problem is a result saying why, never an exception."""
        if self.max_bytes == 0:
            return self._not_stored("the size bound is 0 (TORCHLOOM_CACHE_MAX_BYTES=0)")
        data = encode_entry(entry)
        path = self.path_of(entry.digest)
        try:
            self._make_dirs()  # NOTE: recreates a directory removed while the process runs
            path.parent.mkdir(parents=True, exist_ok=True)
            self._atomic_write(path, data)
            if self.max_bytes is not None:
                self.evict(self.max_bytes)
        except OSError as exc:
            return self._not_stored(f"cache directory {self.root} unusable: {exc}")
        return PutResult(True, self.name, "stored")

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = self._tmp / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def delete(self, digest: str) -> bool:
        try:
            self.path_of(digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def _files(self) -> Iterator[Path]:
        yield from self._entries.glob("*/*.entry")

    def entries(self) -> Iterator[EntryInfo]:
        """Every readable entry's header (unreadable ones are skipped)."""
        for path in self._files():
            info = _read_info(path)
            if info is not None:
                yield info

    def clear(self) -> int:
        removed = 0
        for path in list(self._files()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        for path in self._misses.glob("*.json"):
            path.unlink(missing_ok=True)
        with self._locked():
            self._write_counters({})
        return removed

    def evict(self, max_bytes: int) -> int:
        """Remove least-recently-used entries until the total is under ``max_bytes``."""
        with self._locked():
            files = []
            for path in self._files():
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    files.append((st.st_mtime, st.st_size, path))
            total = sum(size for _, size, _ in files)
            removed = 0
            for _mtime, size, path in sorted(files, key=lambda f: (f[0], f[2].name)):
                if total <= max_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    total -= size
                    removed += 1
            now = time.time()
            for tmp in self._tmp.glob("*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                        tmp.unlink()
        if removed:
            log.info("loom cache: evicted %d entries to stay under %d bytes", removed, max_bytes)
        return removed

    # -- hit/miss bookkeeping ---------------------------------------------
    def record(self, hit: bool) -> None:
        self._bump("hits" if hit else "misses")

    def record_miss(self, key: CacheKey) -> None:
        """Keep the key of a miss so ``torchloom cache explain`` can compare it later."""
        path = self._misses / f"{key.digest}.json"
        record = json.dumps({"time": time.time(), "key": key.to_json()}).encode()
        try:
            self._atomic_write(path, record)
            records = sorted(self._misses.glob("*.json"), key=lambda p: p.stat().st_mtime)
            for old in records[:-_MAX_MISS_RECORDS]:
                old.unlink(missing_ok=True)
        except OSError as exc:  # explanations are best effort
            log.debug("loom cache: could not record the miss: %s", exc)

    def misses(self) -> list[tuple[float, CacheKey]]:
        out = []
        for path in self._misses.glob("*.json"):
            try:
                data = json.loads(path.read_bytes())
                out.append((float(data["time"]), CacheKey.from_json(data["key"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda t: t[0])

    def stats(self) -> StoreStats:
        infos = list(self.entries())
        counters = self._read_counters()
        return StoreStats(
            entries=len(infos),
            bytes=sum(i.size for i in infos),
            hits=int(counters.get("hits", 0)),
            misses=int(counters.get("misses", 0)),
            corrupt=int(counters.get("corrupt", 0)),
            max_bytes=self.max_bytes,
        )

    def _bump(self, counter: str) -> None:
        try:
            with self._locked():
                counters = self._read_counters()
                counters[counter] = int(counters.get(counter, 0)) + 1
                self._write_counters(counters)
        except OSError as exc:  # counters are best effort
            log.debug("loom cache: could not update counters: %s", exc)

    def _read_counters(self) -> dict[str, Any]:
        try:
            data = json.loads((self._dir / "stats.json").read_bytes())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_counters(self, counters: dict[str, Any]) -> None:
        self._atomic_write(self._dir / "stats.json", json.dumps(counters).encode())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._dir / "lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _read_info(path: Path) -> EntryInfo | None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            length = int.from_bytes(head[len(MAGIC) :], "little")
            head += f.read(length)  # the header only, never the payload
            st = os.fstat(f.fileno())
        header, _ = decode_header(head)
        key = CacheKey.from_json(header["key"])
        meta = tuple((str(k), str(v)) for k, v in header.get("meta", []))
        return EntryInfo(key, st.st_size, float(header.get("created", 0.0)), st.st_mtime, meta)
    except (OSError, EntryError, KeyError, TypeError, ValueError):
        return None
