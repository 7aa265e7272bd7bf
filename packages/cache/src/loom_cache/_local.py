"""The embedded local store: one file per entry under the user cache directory.

Invariants:

- Readers never see a partial entry: writes go to a temporary file created
  with ``O_EXCL | O_NOFOLLOW`` and are published with ``os.replace``; a crash
  mid-write leaves only a temporary file that later sweeps remove.
- Nothing inside the store is followed through a symlink: every directory
  below the root is checked with ``lstat`` before use, files are opened with
  ``O_NOFOLLOW``, eviction and ``clear`` open each shard with ``O_NOFOLLOW``
  and remove only regular files named like entries (in private mode, only the
  user's own). A symlink planted in the store is refused with a reason.
- Files are created 0600 and directories 0700 (``mode="shared"``: 0660 and
  2770, for a group). A root owned by someone else or writable by others is
  used with a warning.
- ``put`` is O(1) amortised: a size ledger (in ``stats.json``, under a
  ``filelock`` lock) tracks the total; only when it passes ``max_bytes`` does
  a scan evict least-recently-used entries down to 90% of the bound (a hit
  refreshes the entry's mtime).
- Corrupt, unsigned (when a key is set) and forged entries are removed and
  reported; their payload is never returned.
- A local problem never raises out of the store: lookups miss and puts return
  a :class:`PutResult` saying why. A directory removed while the process runs
  is recreated by the next put; a root the process cannot use (unwritable, an
  uncreatable parent, a file in its place, a symlink inside) turns the local
  tier off with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import filelock

from loom_cache._config import CacheConfig
from loom_cache._entry import MAGIC, Entry, EntryError, decode_checked, decode_header, encode_entry
from loom_cache._key import CacheKey
from loom_cache._store import EntryInfo, Lookup, PutResult, StoreStats

log = logging.getLogger("torchloom.cache")

LAYOUT: Final = "v1"
_STALE_TMP_SECONDS: Final = 3600.0
_MAX_MISS_RECORDS: Final = 200
_LOW_WATER: Final = 0.9
_LOCK_TIMEOUT_S: Final = 10.0
_HEADER_READ: Final = 64 << 10
_ENTRY_NAME: Final = re.compile(r"[0-9a-f]{64}\.entry")
_SHARD_NAME: Final = re.compile(r"[0-9a-f]{2}")
_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
_BINARY: Final = getattr(os, "O_BINARY", 0)
_FD_OPS: Final = (
    os.open in os.supports_dir_fd
    and os.unlink in os.supports_dir_fd
    and os.scandir in os.supports_fd
    and bool(_NOFOLLOW and _DIRECTORY)
)
#: Errors that mean "this directory cannot be used" rather than "try again".
_UNUSABLE: Final = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ELOOP, errno.EEXIST}
)
_warned_roots: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True, slots=True)
class EntrySummary:
    """One line of ``torchloom cache list``: no key components, nothing read from the entry."""

    digest: str
    program: str
    size: int
    created: float
    last_used: float


class UnsafeStoreError(OSError):
    """Something in the store that loom will not follow or remove (a symlink)."""


def default_cache_dir() -> Path:
    """``TORCHLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/torchloom``, else ``~/.cache/torchloom``."""
    return CacheConfig.from_env().dir


def _euid() -> int | None:
    geteuid = getattr(os, "geteuid", None)
    return geteuid() if geteuid is not None else None


def _warn_once(root: Path, what: str, message: str, *args: object) -> None:
    if (str(root), what) not in _warned_roots:
        _warned_roots.add((str(root), what))
        log.warning(message, *args)


class LocalStore:
    """A directory of entries, safe with several processes writing at once.

    >>> import tempfile
    >>> store = LocalStore(tempfile.mkdtemp())
    >>> store.lookup("0" * 64).reason
    'absent'
    """

    name = "local"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        max_bytes: int | None = None,
        *,
        config: CacheConfig | None = None,
    ):
        config = config if config is not None else CacheConfig.from_env()
        if root is not None:
            config = dataclasses.replace(config, dir=Path(root))
        if max_bytes is not None:
            config = dataclasses.replace(config, max_bytes=max_bytes)
        self.config = config
        self.root = config.dir
        self.max_bytes = config.max_bytes
        shared = self._shared = config.mode == "shared"
        self._file_mode = 0o660 if shared else 0o600
        self._dir_mode = 0o2770 if shared else 0o700
        self._dir = self.root / LAYOUT
        self._entries = self._dir / "entries"
        self._tmp = self._dir / "tmp"
        self._misses = self._dir / "misses"
        self._stats = self._dir / "stats.json"
        self._index = self._dir / "index.tsv"
        self._lock = filelock.FileLock(
            str(self._dir / "lock"), timeout=_LOCK_TIMEOUT_S, mode=self._file_mode
        )
        self._warned = False
        #: Why the local tier is off (a root this process cannot use), or None.
        self.off: str | None = None
        try:
            self._make_dirs()
        except OSError as exc:  # said once, by the first put
            if not isinstance(exc, FileNotFoundError):
                self._turn_off(self._describe(exc), warn=False)
        else:
            self._check_owner()

    # -- directories -------------------------------------------------------
    def _describe(self, exc: OSError) -> str:
        if isinstance(exc, UnsafeStoreError):
            return str(exc)
        why = "not a directory" if exc.errno == errno.EEXIST else (exc.strerror or str(exc))
        return f"cache directory {self.root} unusable: {why}"

    def _turn_off(self, reason: str, *, warn: bool = True) -> None:
        self.off = reason
        if warn:
            self._warn_off()

    def _warn_off(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("loom cache: the local tier is off: %s", self.off)

    def _ensure_dir(self, path: Path) -> None:
        """``path`` exists and is a real directory (not a symlink); created if missing."""
        try:
            os.mkdir(path, self._dir_mode)
        except FileExistsError:
            pass
        else:
            if self._shared:  # past the umask: the group must be able to write
                os.chmod(path, self._dir_mode)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeStoreError(
                errno.ELOOP,
                f"{path} is a symlink; loom never follows a symlink inside its store "
                "(remove it, or point TORCHLOOM_CACHE_DIR elsewhere)",
            )
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory")

    def _make_dirs(self) -> None:
        # NOTE: the root itself may be a symlink (a user's choice); below it, never.
        self.root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
        for d in (self._dir, self._entries, self._tmp, self._misses):
            self._ensure_dir(d)

    def _check_owner(self) -> None:
        """Warn (once per directory) when others own the store or may write to it."""
        for path in (self.root, self._dir):
            try:
                st = os.stat(path)
            except OSError:
                return
            euid = _euid()
            if euid is not None and st.st_uid != euid:
                _warn_once(
                    path,
                    "owner",
                    "loom cache: %s is owned by uid %d, not by you (uid %d): whoever owns it "
                    "can change what this process loads unless TORCHLOOM_CACHE_KEY is set",
                    path,
                    st.st_uid,
                    euid,
                )
            if st.st_mode & stat.S_IWOTH:
                _warn_once(
                    path,
                    "world",
                    "loom cache: %s is writable by every user: anyone can plant entries "
                    "unless TORCHLOOM_CACHE_KEY is set; use a private directory",
                    path,
                )
            elif st.st_mode & stat.S_IWGRP and not self._shared:
                _warn_once(
                    path,
                    "group",
                    "loom cache: %s is writable by its group: its members can plant entries "
                    "unless TORCHLOOM_CACHE_KEY is set (TORCHLOOM_CACHE_MODE=shared says "
                    "this is meant)",
                    path,
                )

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

    def _read(self, path: Path) -> bytes:
        st = os.lstat(path.parent)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeStoreError(errno.ELOOP, f"{path.parent} is a symlink; not followed")
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UnsafeStoreError(errno.EINVAL, f"{path} is not a regular file")
            return f.read()

    def lookup(self, digest: str) -> Lookup:
        if self.off is not None:
            return Lookup(None, self.name, f"absent (local tier off: {self.off})")
        path = self.path_of(digest)
        try:
            data = self._read(path)
        except FileNotFoundError:
            return Lookup(None, self.name, "absent")
        except NotADirectoryError:
            return Lookup(None, self.name, f"absent (the cache directory {self.root} is unusable)")
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                log.warning("loom cache: refusing %s: a symlink inside the store", path)
                return Lookup(None, self.name, f"refused: {path} is a symlink inside the store")
            return Lookup(None, self.name, f"unreadable: {exc}")
        try:
            entry, verified = decode_checked(
                data, digest, self.config.keys, self.config.signing, None
            )
        except EntryError as exc:
            log.warning("loom cache: dropping entry %s: %s", digest[:12], exc)
            self._remove(path, len(data))
            self._bump("corrupt")
            return Lookup(None, self.name, f"corrupt entry: {exc}")
        with contextlib.suppress(OSError):
            os.utime(path, follow_symlinks=False)  # LRU: a hit is a use
        return Lookup(entry, self.name, "hit", verified)

    def put(self, entry: Entry) -> PutResult:
        """Store ``entry``; a local problem is a result saying why, never an exception."""
        if self.off is not None:
            self._warn_off()
            return PutResult(False, self.name, f"local tier off: {self.off}")
        if self.max_bytes == 0:
            return self._not_stored("the size bound is 0 (TORCHLOOM_CACHE_MAX_BYTES=0)")
        key = self.config.keys[0] if self.config.keys else None
        data = encode_entry(entry, key=key, namespace=self.config.namespace)
        if len(data) > self.max_bytes:
            return PutResult(
                False, self.name, f"entry of {len(data)} bytes exceeds the bound {self.max_bytes}"
            )
        path = self.path_of(entry.digest)
        try:
            self._make_dirs()  # NOTE: recreates a directory removed while the process runs
            self._check_owner()
        except OSError as exc:
            self._turn_off(self._describe(exc))
            return PutResult(False, self.name, f"local tier off: {self.off}")
        try:
            self._ensure_dir(path.parent)
            tmp = self._write_tmp(path.name, data)
            try:
                with self._locked():
                    old = _regular_size(path)
                    os.replace(tmp, path)
                    self._account(len(data) - old)
                    self._index_append(entry)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            return self._not_stored(f"{self._describe(exc)}")
        return PutResult(True, self.name, "stored")

    def _write_tmp(self, name: str, data: bytes) -> Path:
        tmp = self._tmp / f"{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY
        fd = os.open(tmp, flags, self._file_mode)
        try:
            if self._shared and hasattr(os, "fchmod"):
                os.fchmod(fd, self._file_mode)  # past the umask
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = self._write_tmp(path.name, data)
        try:
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _remove(self, path: Path, size: int) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
            with self._locked():
                self._account(-size, evict=False)

    def delete(self, digest: str) -> bool:
        path = self.path_of(digest)
        try:
            st = os.lstat(path.parent)
            if stat.S_ISLNK(st.st_mode):
                return False
            size = _regular_size(path)
            os.unlink(path)
        except OSError:
            return False
        with contextlib.suppress(OSError), self._locked():
            self._account(-size, evict=False)
        return True

    # -- scanning (own files only, never through a symlink) -----------------
    @contextlib.contextmanager
    def _shards(self) -> Iterator[Iterator[tuple[Any, str]]]:
        """Each real shard directory as ``(dir_fd or path, name)`` pairs of its entries."""
        opened: list[int] = []

        def walk() -> Iterator[tuple[Any, str]]:
            try:
                shards = list(os.scandir(self._entries))
            except OSError:
                return
            for shard in shards:
                if not (_SHARD_NAME.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                    continue
                where: Any
                if _FD_OPS:
                    try:
                        fd = os.open(shard.path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
                    except OSError:
                        continue
                    opened.append(fd)
                    where = fd
                else:  # pragma: no cover - platforms without dir_fd
                    where = shard.path
                try:
                    names = list(os.scandir(where))
                except OSError:
                    continue
                for item in names:
                    if _ENTRY_NAME.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                        yield where, item.name

        try:
            yield walk()
        finally:
            for fd in opened:
                os.close(fd)

    def _own(self, st: os.stat_result) -> bool:
        euid = _euid()
        return self.config.mode == "shared" or euid is None or st.st_uid == euid

    @contextlib.contextmanager
    def _scanned(self) -> Iterator[list[tuple[float, int, Any, str]]]:
        """``(mtime, size, where, name)`` of every entry file of the store's own; the
        shard descriptors in ``where`` stay open inside the ``with`` block."""
        out = []
        with self._shards() as items:
            for where, name in items:
                try:
                    st = _stat(where, name)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and self._own(st):
                    out.append((st.st_mtime, st.st_size, where, name))
            yield out

    def _total(self) -> tuple[int, int]:
        with self._scanned() as files:
            return len(files), sum(size for _, size, _, _ in files)

    # -- the listing index --------------------------------------------------
    def _index_append(self, entry: Entry) -> None:
        """One line per put (digest, created, program), so listing reads no entry."""
        program = entry.key.program.replace("\t", " ").replace("\n", " ")
        line = f"{entry.digest}\t{entry.created!r}\t{program}\n".encode()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _BINARY
        try:
            fd = os.open(self._index, flags, self._file_mode)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:  # the listing falls back to reading headers
            log.debug("loom cache: could not append to the index: %s", exc)

    def _read_index(self) -> dict[str, tuple[float, str]]:
        try:
            fd = os.open(self._index, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY)
            with os.fdopen(fd, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return {}
        out: dict[str, tuple[float, str]] = {}
        for line in text.splitlines():
            parts = line.split("\t", 2)
            if len(parts) == 3 and len(parts[0]) == 64:
                with contextlib.suppress(ValueError):
                    out[parts[0]] = (float(parts[1]), parts[2])
        return out

    def _compact_index(self) -> None:
        """Rewrite the index with the entries present (lock held; after eviction/clear)."""
        index = self._read_index()
        with self._scanned() as files:
            present = {name[:64] for _, _, _, name in files}
        lines = "".join(
            f"{d}\t{c!r}\t{p}\n" for d, (c, p) in index.items() if d in present
        ).encode()
        with contextlib.suppress(OSError):
            self._atomic_write(self._index, lines)

    def summaries(self) -> list[EntrySummary]:
        """Every entry's digest, program, size and times, from one directory scan and
        the index (an entry the index lacks has its header read)."""
        index = self._read_index()
        out = []
        with self._shards() as items:
            for where, name in items:
                digest = name[:64]
                try:
                    st = _stat(where, name)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                known = index.get(digest)
                if known is None:
                    info = _read_info(where, name)
                    if info is None:
                        continue
                    known = (info.created, info.key.program)
                out.append(EntrySummary(digest, known[1], st.st_size, known[0], st.st_mtime))
        return out

    def info(self, digest: str) -> EntryInfo | None:
        """One entry's header (key components, metadata), or None."""
        path = self.path_of(digest)
        try:
            if stat.S_ISLNK(os.lstat(path.parent).st_mode):
                return None
        except OSError:
            return None
        return _read_info(str(path.parent), path.name)

    def entries(self) -> Iterator[EntryInfo]:
        """Every readable entry's header (unreadable ones are skipped)."""
        with self._shards() as items:
            for where, name in items:
                info = _read_info(where, name)
                if info is not None:
                    yield info

    def clear(self) -> int:
        removed = 0
        try:
            with self._locked(), self._scanned() as files:
                for _, _, where, name in files:
                    with contextlib.suppress(OSError):
                        _unlink(where, name)
                        removed += 1
                with contextlib.suppress(OSError):
                    for item in os.scandir(self._misses):
                        if item.name.endswith(".json") and item.is_file(follow_symlinks=False):
                            os.unlink(item.path)
                self._write_counters({"bytes": 0})
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._index)
        except OSError as exc:
            log.warning("loom cache: could not clear %s: %s", self.root, exc)
        return removed

    def evict(self, max_bytes: int) -> int:
        """Remove least-recently-used entries until the total is under ``max_bytes``."""
        try:
            with self._locked():
                total, removed = self._evict_locked(max_bytes)
                counters = self._read_counters()
                counters["bytes"] = total
                self._write_counters(counters)
        except OSError as exc:
            log.debug("loom cache: eviction skipped: %s", exc)
            return 0
        return removed

    def _evict_locked(self, target: int) -> tuple[int, int]:
        removed = 0
        with self._scanned() as files:
            total = sum(size for _, size, _, _ in files)
            if total > target:
                for _mtime, size, where, name in sorted(files, key=lambda f: (f[0], f[3])):
                    if total <= target:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        _unlink(where, name)
                        total -= size
                        removed += 1
        self._sweep_tmp()
        if removed:
            self._compact_index()
            log.info("loom cache: evicted %d entries to stay under %d bytes", removed, target)
        return total, removed

    def _sweep_tmp(self) -> None:
        """Remove temporaries that crashed writers left (the directory is ~empty)."""
        now = time.time()
        with contextlib.suppress(OSError):
            for tmp in os.scandir(self._tmp):
                with contextlib.suppress(OSError):
                    st = tmp.stat(follow_symlinks=False)
                    if (
                        tmp.name.endswith(".tmp")
                        and stat.S_ISREG(st.st_mode)
                        and now - st.st_mtime > _STALE_TMP_SECONDS
                    ):
                        os.unlink(tmp.path)

    def _account(self, delta: int, *, evict: bool = True) -> None:
        """Add ``delta`` bytes to the ledger (lock held); evict in a batch past the bound."""
        counters = self._read_counters()
        total = counters.get("bytes")
        if not isinstance(total, int) or total < 0:
            total = self._total()[1]  # first use: count once
        else:
            total = max(0, total + delta)
        if evict and total > self.max_bytes:
            total, _ = self._evict_locked(int(self.max_bytes * _LOW_WATER))
        elif evict:
            self._sweep_tmp()
        counters["bytes"] = total
        self._write_counters(counters)

    # -- hit/miss bookkeeping ---------------------------------------------
    def record(self, hit: bool) -> None:
        self._bump("hits" if hit else "misses")

    def record_miss(self, key: CacheKey) -> None:
        """Keep the key of a miss so ``torchloom cache explain`` can compare it later."""
        if self.off is not None:
            return
        path = self._misses / f"{key.digest}.json"
        record = json.dumps({"time": time.time(), "key": key.to_json()}).encode()
        try:
            self._ensure_dir(self._misses)
            self._atomic_write(path, record)
            records = []
            for item in os.scandir(self._misses):
                if item.name.endswith(".json") and item.is_file(follow_symlinks=False):
                    records.append((item.stat(follow_symlinks=False).st_mtime, item.path))
            for _, old in sorted(records)[:-_MAX_MISS_RECORDS]:
                os.unlink(old)
        except OSError as exc:  # explanations are best effort
            log.debug("loom cache: could not record the miss: %s", exc)

    def misses(self) -> list[tuple[float, CacheKey]]:
        out = []
        try:
            items = [i for i in os.scandir(self._misses) if i.name.endswith(".json")]
        except OSError:
            return []
        for item in items:
            try:
                fd = os.open(item.path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    data = json.loads(f.read())
                out.append((float(data["time"]), CacheKey.from_json(data["key"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda t: t[0])

    def stats(self) -> StoreStats:
        """Entries and bytes from one directory scan (no entry is read) and the counters."""
        entries, size = self._total()
        counters = self._read_counters()
        return StoreStats(
            entries=entries,
            bytes=size,
            hits=int(counters.get("hits", 0)),
            misses=int(counters.get("misses", 0)),
            corrupt=int(counters.get("corrupt", 0)),
            max_bytes=self.max_bytes,
        )

    def _bump(self, counter: str) -> None:
        if self.off is not None:
            return
        try:
            with self._locked():
                counters = self._read_counters()
                counters[counter] = int(counters.get(counter, 0)) + 1
                self._write_counters(counters)
        except OSError as exc:  # counters are best effort
            log.debug("loom cache: could not update counters: %s", exc)

    def _read_counters(self) -> dict[str, Any]:
        try:
            fd = os.open(self._stats, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_counters(self, counters: dict[str, Any]) -> None:
        tmp = self._tmp / f"stats.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY
        fd = os.open(tmp, flags, self._file_mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(counters).encode())
            os.replace(tmp, self._stats)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock_path = self._dir / "lock"
        try:
            st = os.lstat(lock_path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeStoreError(
                    errno.ELOOP, f"{lock_path} is not a regular file (a symlink?); not followed"
                )
        with self._lock:
            yield


def _stat(where: Any, name: str) -> os.stat_result:
    if isinstance(where, int):
        return os.stat(name, dir_fd=where, follow_symlinks=False)
    return os.lstat(os.path.join(where, name))  # pragma: no cover - no dir_fd


def _unlink(where: Any, name: str) -> None:
    if isinstance(where, int):
        os.unlink(name, dir_fd=where)
    else:  # pragma: no cover - no dir_fd
        os.unlink(os.path.join(where, name))


def _regular_size(path: Path) -> int:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _read_info(where: Any, name: str) -> EntryInfo | None:
    """An entry's header (one read; the payload beyond it is never parsed)."""
    try:
        flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY
        if isinstance(where, int):
            fd = os.open(name, flags, dir_fd=where)
        else:
            fd = os.open(os.path.join(where, name), flags)
        try:
            st = os.fstat(fd)
            head = os.read(fd, _HEADER_READ)
            length = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 4], "little")
            if len(MAGIC) + 4 + length > len(head):
                head += os.read(fd, len(MAGIC) + 4 + length - len(head))
        finally:
            os.close(fd)
        header, _ = decode_header(head)
        key = CacheKey.from_json(header["key"])
        meta = tuple((str(k), str(v)) for k, v in header.get("meta", []))
        return EntryInfo(key, st.st_size, float(header.get("created", 0.0)), st.st_mtime, meta)
    except (OSError, EntryError, KeyError, TypeError, ValueError):
        return None
