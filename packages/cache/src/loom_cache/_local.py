"""The embedded local store: one file per entry under the user cache directory.

Invariants:

- Readers never see a partial entry: writes go to a temporary file created
  with ``O_EXCL | O_NOFOLLOW`` and are published with ``os.replace``; a crash
  mid-write leaves only a temporary file, which the next put's sweep removes once
  its writer is evidently dead: its name carries the writer's host and pid, and
  that pid is gone on this host; a temporary whose owner cannot be probed (another
  host's) once it is older than five minutes. A live writer's is never swept.
- Nothing inside the store is followed through a symlink: every read, scan,
  unlink and rename goes through a directory descriptor opened one component at
  a time from the root down with ``O_NOFOLLOW`` (``LocalStore._opened``), files
  are opened with ``O_NOFOLLOW``, and eviction and ``clear`` remove only regular
  files named like entries (in private mode, only the user's own). A symlink
  planted in the store, before the process opened it or while it runs, is
  refused with a reason; ``clear`` refuses a tree with one in place of a
  directory and removes nothing.
- Files are created 0600 and directories 0700 (``mode="shared"``: 0660 and
  2770, for a group). A root owned by someone else or writable by others is
  used with a warning.
- No read waits on a lock, and no lock is held for long. Hit, miss and
  corrupt counters and the size ledger's deltas are lock-free ``O_APPEND``
  writes (one byte per event, one line per delta); whoever next gets the
  store's ``filelock`` lock without waiting folds them into ``stats.json`` and
  ``ledger.json`` (a rename claims them, so no append is counted twice).
  Entries are published with ``os.replace`` outside the lock.
- ``put`` is O(1) amortised: the ledger tracks the total; only when it passes
  ``max_bytes`` does one process (a second lock, taken without waiting)
  evict least-recently-used entries down to 90% of the bound, scanning and
  unlinking outside the store lock (a hit refreshes the entry's mtime). A
  missing ledger (a disk that filled while writing it) is rebuilt by a scan
  on the next open.
- Corrupt, unsigned (when a key is set) and forged entries are removed and
  reported; their payload is never returned. An entry signed with a key this
  reader does not hold is another key holder's: a miss, never removed here
  (eviction, by age, may).
- A local problem never raises out of the store: lookups miss and puts return
  a :class:`PutResult` saying why, in words that name the problem (a full
  disk, a busy lock, an unusable directory). A directory removed while the
  process runs is recreated by the next put; a root the process cannot use
  (unwritable, an uncreatable parent, a file in its place, a symlink inside)
  turns the local tier off with one warning.
- Each ``TORCHLOOM_CACHE_NAMESPACE`` has its own tree (``<root>/ns-<name>/v1``;
  no namespace: ``<root>/v1``), so namespaces sharing a directory never serve
  each other's entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import filelock

from loom_cache._config import CacheConfig
from loom_cache._entry import (
    MAGIC,
    Entry,
    EntryError,
    ForeignEntry,
    decode_checked,
    decode_header,
    encode_parts,
)
from loom_cache._key import CacheKey
from loom_cache._store import EntryInfo, Lookup, PutResult, StoreStats

log = logging.getLogger("torchloom.cache")

LAYOUT: Final = "v1"
#: A temporary whose writer cannot be probed (another host's) is a dead writer's once
#: older than this (a write takes seconds).
_STALE_TMP_SECONDS: Final = 300.0
_MAX_PID: Final = 2**31 - 1
#: This host, as temporaries' names carry it (with the writer's pid).
_HOST: Final = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"
_MAX_MISS_RECORDS: Final = 200
_LOW_WATER: Final = 0.9
_LOCK_TIMEOUT_S: Final = 10.0
#: Bookkeeping (folding journals, setting the ledger) waits at most this long.
_BRIEF_LOCK_S: Final = 1.0
_COUNTERS: Final = ("hits", "misses", "corrupt")
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
    and os.rename in os.supports_dir_fd
    and os.stat in os.supports_dir_fd
    and os.scandir in os.supports_fd
    and bool(_NOFOLLOW and _DIRECTORY)
)
_DIR_FLAGS: Final = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC
_JOURNAL: Final = "ledger.log"
_LEDGER: Final = "ledger.json"
_INDEX: Final = "index.tsv"
#: A directory of the store: a descriptor opened ``O_NOFOLLOW`` from the root down, or,
#: where the platform has no ``dir_fd``, a path whose every component was ``lstat``-ed.
_Where = int | str
#: Errors that mean "this directory cannot be used" rather than "try again".
_UNUSABLE: Final = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ELOOP, errno.EEXIST}
)
_FULL: Final = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
#: Errors that mean "a limit was reached" (a full disk, a quota, a file size limit):
#: a not-stored, never an unusable directory.
_LIMITS: Final = _FULL | {errno.EFBIG}
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
        create: bool = True,
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
        #: Where this namespace's tree lives (the root itself without a namespace).
        self.base = self.root / f"ns-{config.namespace}" if config.namespace else self.root
        self._dir = self.base / LAYOUT
        self._entries = self._dir / "entries"
        self._tmp = self._dir / "tmp"
        self._misses = self._dir / "misses"
        self._stats = self._dir / "stats.json"
        self._ledger = self._dir / _LEDGER
        self._lock = filelock.FileLock(
            str(self._dir / "lock"), timeout=_LOCK_TIMEOUT_S, mode=self._file_mode
        )
        self._evict_lock = filelock.FileLock(
            str(self._dir / "evict.lock"), timeout=_LOCK_TIMEOUT_S, mode=self._file_mode
        )
        self._warned = False
        #: Why the local tier is off (a root this process cannot use), or None.
        self.off: str | None = None
        if not create and not self._dir.is_dir():
            return  # NOTE: nothing to read, and a read-only command creates nothing
        try:
            self._make_dirs()
        except OSError as exc:  # said once, by the first put
            if not isinstance(exc, FileNotFoundError):
                self._turn_off(self._describe(exc), warn=False)
        else:
            self._check_owner()
            if self._read_json(self._ledger).get("bytes") is None:
                self._rebuild_ledger()

    # -- directories -------------------------------------------------------
    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, filelock.Timeout):
            return (
                f"cache directory {self.root} is busy: another process held {exc.lock_file} "
                f"for over {_LOCK_TIMEOUT_S:g} s"
            )
        if isinstance(exc, UnsafeStoreError):
            return str(exc)
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return f"disk full: cannot write under {self.root} ({exc.strerror})"
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            return (
                f"file size limit: cannot write under {self.root} ({exc.strerror}: the "
                "process's limit, ulimit -f, or the filesystem's largest file)"
            )
        if not isinstance(exc, OSError):
            return f"cache directory {self.root}: {exc!r}"
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
        _check_dir(os.lstat(path), path)

    def _make_dirs(self) -> None:
        # NOTE: the root itself may be a symlink (a user's choice); below it, never.
        self.root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
        below = (self._dir, self._entries, self._tmp, self._misses)
        for d in (self.base, *below) if self.base != self.root else below:
            self._ensure_dir(d)
        for lock in (self._lock, self._evict_lock):
            _check_regular(Path(lock.lock_file))

    @contextlib.contextmanager
    def _opened(self, *parts: str) -> Iterator[_Where]:
        """The directory ``<base>/v1/<parts>``, reached one component at a time below the
        root, none of them followed if it is a symlink (:class:`UnsafeStoreError`).

        Every scan, read, unlink and rename inside the store goes through it, so a
        directory swapped for a symlink while the process runs is refused too."""
        below = (self.base.name,) if self.base != self.root else ()
        with contextlib.ExitStack() as stack:
            where: _Where = str(self.root)
            if _FD_OPS:  # NOTE: the root itself may be a symlink (a user's choice)
                where = os.open(self.root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
                stack.callback(os.close, where)
            shown = self.root
            for name in (*below, LAYOUT, *parts):
                shown = shown / name
                where = stack.enter_context(_subdir(where, name, shown))
            yield where

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
            log.warning("loom cache: the local tier stored nothing: %s", reason)
        else:
            log.debug("loom cache: not stored: %s", reason)
        return PutResult(False, self.name, reason)

    # -- entries -----------------------------------------------------------
    def path_of(self, digest: str) -> Path:
        return self._entries / digest[:2] / f"{digest}.entry"

    def lookup(self, digest: str) -> Lookup:
        """The entry, or a miss with its reason; never waits on the store's lock."""
        if self.off is not None:
            return Lookup(None, self.name, f"absent (local tier off: {self.off})")
        if self.config.key_missing is not None:
            return Lookup(None, self.name, f"refused (fail closed): {self.config.key_missing}")
        path, name = self.path_of(digest), f"{digest}.entry"
        try:
            with self._opened("entries", digest[:2]) as shard:
                data = _read_regular(shard, name)
                try:
                    entry, verified = decode_checked(
                        data, digest, self.config.keys, self.config.signing, self.config.namespace
                    )
                except EntryError as exc:
                    refused: EntryError | None = exc
                else:
                    refused = None
                    with contextlib.suppress(OSError):  # LRU: a hit is a use
                        _touch(shard, name)
        except FileNotFoundError:
            return Lookup(None, self.name, "absent")
        except NotADirectoryError:
            return Lookup(None, self.name, f"absent (the cache directory {self.root} is unusable)")
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                log.warning("loom cache: refusing %s: a symlink inside the store", path)
                return Lookup(None, self.name, f"refused: {path} is a symlink inside the store")
            return Lookup(None, self.name, f"unreadable: {exc}")
        if isinstance(refused, ForeignEntry):
            log.info("loom cache: skipping entry %s: %s", digest[:12], refused)
            return Lookup(None, self.name, f"foreign entry (left for its owner): {refused}")
        if refused is not None:
            log.warning("loom cache: dropping entry %s: %s", digest[:12], refused)
            self._remove(digest, len(data))
            self._bump("corrupt")
            return Lookup(None, self.name, f"corrupt entry: {refused}")
        return Lookup(entry, self.name, "hit", verified)

    def put(self, entry: Entry) -> PutResult:
        """Store ``entry``; a local problem is a result saying why, never an exception.

        The entry is published first (``os.replace``, no lock); the bookkeeping after
        it (ledger, index, eviction) never decides whether it was stored."""
        if self.off is not None:
            self._warn_off()
            return PutResult(False, self.name, f"local tier off: {self.off}")
        if self.config.key_missing is not None:
            return PutResult(False, self.name, f"fail closed: {self.config.key_missing}")
        if self.max_bytes == 0:
            return self._not_stored("the size bound is 0 (TORCHLOOM_CACHE_MAX_BYTES=0)")
        key = self.config.keys[0] if self.config.keys else None
        # NOTE: written as parts: a large payload is never copied into one buffer
        head, trailer = encode_parts(entry, key=key, namespace=self.config.namespace)
        size = len(head) + len(entry.payload) + len(trailer)
        if size > self.max_bytes:
            return PutResult(
                False, self.name, f"entry of {size} bytes exceeds the bound {self.max_bytes}"
            )
        path, name, shard = self.path_of(entry.digest), f"{entry.digest}.entry", entry.digest[:2]
        try:
            self._make_dirs()  # NOTE: recreates a directory removed while the process runs
            self._check_owner()
        except OSError as exc:
            if isinstance(exc, UnsafeStoreError) or exc.errno in _UNUSABLE:
                self._turn_off(self._describe(exc))
                return PutResult(False, self.name, f"local tier off: {self.off}")
            return self._not_stored(self._describe(exc))
        try:
            self._ensure_shard(shard)
            tmp = self._write_tmp(name, head, entry.payload, trailer).name
            published = False
            try:
                with self._opened("tmp") as tmp_dir, self._opened("entries", shard) as where:
                    old = _regular_size(where, name)
                    _replace(tmp_dir, tmp, where, name)
                    published = True
            finally:
                if not published:
                    self._discard_tmp(tmp)
        except OSError as exc:
            return self._not_stored(self._describe(exc))
        try:
            self._append(_JOURNAL, f"{size - old}\n".encode())
            self._index_append(entry)
            self._maintain()
        except OSError as exc:
            # NOTE: the entry is published: say so. The ledger may now be off; drop
            # it (an unlink works on a full disk) so the next open counts afresh.
            with contextlib.suppress(OSError), self._opened() as layout:
                _unlink_at(layout, _LEDGER)
            reason = self._describe(exc)
            log.warning("loom cache: stored %s, but its bookkeeping failed: %s", path, reason)
            return PutResult(True, self.name, f"stored (bookkeeping skipped: {reason})")
        return PutResult(True, self.name, "stored")

    def _ensure_shard(self, shard: str) -> None:
        """``entries/<shard>`` exists, a real directory (created if missing)."""
        with self._opened("entries") as entries:
            try:
                if isinstance(entries, int):
                    os.mkdir(shard, self._dir_mode, dir_fd=entries)
                else:  # pragma: no cover - no dir_fd
                    os.mkdir(os.path.join(entries, shard), self._dir_mode)
            except FileExistsError:
                return
            if self._shared:  # past the umask: the group must be able to write
                with _subdir(entries, shard, self._entries / shard) as made:
                    os.chmod(made, self._dir_mode)

    def _write_tmp(self, name: str, *parts: bytes | bytearray, sync: bool = True) -> Path:
        """A new temporary in ``tmp`` holding ``parts`` (its name carries host and pid)."""
        tmp = _tmp_name(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY
        with self._opened("tmp") as where:
            fd = _open_in(where, tmp, flags, self._file_mode)
            try:
                if self._shared and hasattr(os, "fchmod"):
                    os.fchmod(fd, self._file_mode)  # past the umask
                with os.fdopen(fd, "wb") as f:
                    for part in parts:
                        f.write(part)
                    f.flush()
                    if sync:
                        os.fsync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    _unlink(where, tmp)
                raise
        return self._tmp / tmp

    def _discard_tmp(self, tmp: str) -> None:
        with contextlib.suppress(OSError), self._opened("tmp") as where:
            _unlink(where, tmp)

    def _atomic_write(
        self, parts: tuple[str, ...], name: str, data: bytes, *, sync: bool = True
    ) -> None:
        """Write ``v1/<parts>/<name>`` whole or not at all."""
        tmp = self._write_tmp(name, data, sync=sync).name
        published = False
        try:
            with self._opened("tmp") as tmp_dir, self._opened(*parts) as where:
                _replace(tmp_dir, tmp, where, name)
                published = True
        finally:
            if not published:
                self._discard_tmp(tmp)

    def _append(self, name: str, data: bytes) -> None:
        """One ``O_APPEND`` write to ``v1/<name>``: atomic for these few bytes, and no lock."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _BINARY
        with self._opened() as layout:
            fd = _open_in(layout, name, flags, self._file_mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _remove(self, digest: str, size: int) -> None:
        with contextlib.suppress(OSError):
            with self._opened("entries", digest[:2]) as shard:
                _unlink(shard, f"{digest}.entry")
            self._append(_JOURNAL, f"{-size}\n".encode())

    def delete(self, digest: str) -> bool:
        try:
            with self._opened("entries", digest[:2]) as shard:
                size = _regular_size(shard, f"{digest}.entry")
                _unlink(shard, f"{digest}.entry")
        except OSError:
            return False
        with contextlib.suppress(OSError):
            self._append(_JOURNAL, f"{-size}\n".encode())
        return True

    # -- scanning (own files only, never through a symlink) -----------------
    @contextlib.contextmanager
    def _shards(self) -> Iterator[Iterator[tuple[_Where, str]]]:
        """Each real shard directory as ``(dir_fd or path, name)`` pairs of its entries;
        a symlinked ``entries`` or shard is skipped, never followed."""
        with contextlib.ExitStack() as stack:

            def walk() -> Iterator[tuple[_Where, str]]:
                try:
                    entries = stack.enter_context(self._opened("entries"))
                    shards = [
                        s.name
                        for s in os.scandir(entries)
                        if _SHARD_NAME.fullmatch(s.name) and s.is_dir(follow_symlinks=False)
                    ]
                except OSError as exc:
                    log.debug("loom cache: no entries scanned: %s", exc)
                    return
                for shard in shards:
                    try:
                        where = stack.enter_context(_subdir(entries, shard, self._entries / shard))
                        names = list(os.scandir(where))
                    except OSError:
                        continue
                    for item in names:
                        if _ENTRY_NAME.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                            yield where, item.name

            yield walk()

    def _own(self, st: os.stat_result) -> bool:
        euid = _euid()
        return self.config.mode == "shared" or euid is None or st.st_uid == euid

    @contextlib.contextmanager
    def _scanned(self) -> Iterator[list[tuple[float, int, _Where, str]]]:
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
        try:
            self._append(_INDEX, line)
        except OSError as exc:  # the listing falls back to reading headers
            if exc.errno in _LIMITS:
                raise
            log.debug("loom cache: could not append to the index: %s", exc)

    def _read_index(self) -> dict[str, tuple[float, str]]:
        try:
            with self._opened() as layout:
                text = _read_regular(layout, _INDEX).decode(errors="replace")
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
        """Rewrite the index with the entries present (after eviction; no lock: a line
        a concurrent put appends meanwhile may be lost, and listing then reads that
        entry's header)."""
        index = self._read_index()
        with self._scanned() as files:
            present = {name[:64] for _, _, _, name in files}
        lines = "".join(
            f"{d}\t{c!r}\t{p}\n" for d, (c, p) in index.items() if d in present
        ).encode()
        with contextlib.suppress(OSError):
            self._atomic_write((), _INDEX, lines)

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
        try:
            with self._opened("entries", digest[:2]) as shard:
                return _read_info(shard, f"{digest}.entry")
        except OSError:
            return None

    def entries(self) -> Iterator[EntryInfo]:
        """Every readable entry's header (unreadable ones are skipped)."""
        with self._shards() as items:
            for where, name in items:
                info = _read_info(where, name)
                if info is not None:
                    yield info

    def clear(self) -> int:
        """Remove every entry of this namespace's tree, its counters and recorded misses.

        A tree with a symlink (or anything but a directory) in place of one of its
        directories is refused whole: nothing is removed, and the local tier is off
        with the reason (``off``)."""
        removed = 0
        if not self._dir.is_dir():
            return 0
        try:
            for parts in ((), ("entries",), ("tmp",), ("misses",)):
                with contextlib.suppress(FileNotFoundError), self._opened(*parts):
                    pass
        except OSError as exc:
            self._turn_off(self._describe(exc), warn=False)
            log.warning("loom cache: refusing to clear %s: %s", self.base, self.off)
            return 0
        try:
            with self._locked(self._evict_lock, _LOCK_TIMEOUT_S):
                with self._scanned() as files:
                    for _, _, where, name in files:
                        with contextlib.suppress(OSError):
                            _unlink(where, name)
                            removed += 1
                with contextlib.suppress(FileNotFoundError), self._opened("misses") as misses:
                    for item in os.scandir(misses):
                        if item.name.endswith(".json") and item.is_file(follow_symlinks=False):
                            _unlink_at(misses, item.name)
                with self._locked(self._lock, _LOCK_TIMEOUT_S):
                    with self._opened() as layout, self._opened("tmp") as tmp:
                        for part in self._claim(layout, tmp):
                            _unlink_at(tmp, part)
                        with contextlib.suppress(FileNotFoundError):
                            _unlink_at(layout, _INDEX)
                    self._write_json(self._stats, {})
                    self._write_json(self._ledger, {"bytes": 0})
        except (OSError, filelock.Timeout) as exc:
            log.warning("loom cache: could not clear %s: %s", self.base, self._describe(exc))
        return removed

    # -- size bound ----------------------------------------------------------
    def evict(self, max_bytes: int) -> int:
        """Remove least-recently-used entries until the total is under ``max_bytes``;
        waits for another process's eviction, never holds the store's lock while
        scanning or unlinking. Returns how many entries were removed."""
        try:
            with self._locked(self._evict_lock, _LOCK_TIMEOUT_S):
                return self._evict_to(max_bytes)
        except (OSError, filelock.Timeout) as exc:
            log.info("loom cache: eviction skipped: %s", self._describe(exc))
            return 0

    def _evict_to(self, target: int) -> int:
        """Evict down to ``target`` (the eviction lock held): fold the journal, scan
        and unlink with no lock, then set the ledger to what is left plus what other
        processes journaled meanwhile (those they published during the scan may be
        counted twice: an over-count, which the next eviction's scan corrects)."""
        with self._locked(self._lock, _BRIEF_LOCK_S):
            self._fold()
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
        with self._locked(self._lock, _BRIEF_LOCK_S):
            self._fold(base=total)
        self._sweep_tmp()
        if removed:
            self._compact_index()
            log.info("loom cache: evicted %d entries to stay under %d bytes", removed, target)
        return removed

    def _maintain(self) -> None:
        """After a put: fold the journals if the lock is free right now, and evict in
        one batch past the bound if no other process is evicting. Never waits."""
        with self._try_locked(self._lock) as held:
            if not held:
                return  # its holder, or the next put, folds
            total = self._fold().get("bytes")
        if total is None:
            self._rebuild_ledger()
        elif total > self.max_bytes:
            with self._try_locked(self._evict_lock) as held:
                if not held:
                    return  # another process is evicting
                try:
                    self._evict_to(int(self.max_bytes * _LOW_WATER))
                except filelock.Timeout as exc:
                    log.info("loom cache: eviction skipped: %s", self._describe(exc))
        else:
            self._sweep_tmp()

    def _rebuild_ledger(self) -> None:
        """Count the store once (no lock while scanning) and write the ledger."""
        with self._try_locked(self._evict_lock) as held:
            if not held:
                return
            try:
                total = self._total()[1]
                with self._locked(self._lock, _BRIEF_LOCK_S):
                    self._fold(base=total, journaled=False)
            except (OSError, filelock.Timeout) as exc:
                log.debug("loom cache: the size ledger was not rebuilt: %s", exc)

    def _sweep_tmp(self) -> None:
        """Remove temporaries that dead writers left (the directory is ~empty)."""
        now = time.time()
        with contextlib.suppress(OSError), self._opened("tmp") as tmp:
            for item in os.scandir(tmp):
                with contextlib.suppress(OSError):
                    st = item.stat(follow_symlinks=False)
                    if (
                        item.name.endswith(".tmp")
                        and stat.S_ISREG(st.st_mode)
                        and _writer_gone(item.name, now - st.st_mtime)
                    ):
                        _unlink_at(tmp, item.name)
                        log.debug("loom cache: removed %s, a dead writer's", self._tmp / item.name)

    # -- journals: counters and ledger deltas, appended without a lock --------
    def _claim(self, layout: _Where, tmp: _Where) -> list[str]:
        """Rename the live journals aside (lock held) and return every claimed part in
        ``tmp``, with any an earlier fold could not finish. Appends after the rename
        start a new file, so nothing is folded twice."""
        token = uuid.uuid4().hex
        for live, kind in [(_JOURNAL, "ledger")] + [(f"{c}.count", c) for c in _COUNTERS]:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(_stat(layout, live).st_mode):  # a planted link is never read
                    _replace(layout, live, tmp, f"fold.{token}.{kind}")
        return [
            item.name
            for item in os.scandir(tmp)
            if item.name.startswith("fold.") and item.is_file(follow_symlinks=False)
        ]

    def _fold(self, base: int | None = None, *, journaled: bool = True) -> dict[str, Any]:
        """Add the journals to ``stats.json`` and ``ledger.json`` (lock held) and return
        the ledger. ``base``: the ledger's new value before the journaled deltas
        (``journaled=False``: drop them, ``base`` counted them already)."""
        with self._opened() as layout, self._opened("tmp") as tmp:
            parts = self._claim(layout, tmp)
            counters = self._read_json(self._stats)
            ledger = self._read_json(self._ledger)
            total = ledger.get("bytes") if base is None else base
            for part in parts:
                kind = part.rsplit(".", 1)[1]
                if kind == "ledger":
                    if journaled and isinstance(total, int):
                        total += _sum_lines(tmp, part)
                elif kind in _COUNTERS:
                    counters[kind] = int(counters.get(kind, 0)) + _stat(tmp, part).st_size
            if parts:
                self._write_json(self._stats, counters)
            ledger = {"bytes": max(0, total)} if isinstance(total, int) else {}
            if parts or base is not None:
                self._write_json(self._ledger, ledger)
            for part in parts:
                with contextlib.suppress(OSError):
                    _unlink_at(tmp, part)
        return ledger

    # -- hit/miss bookkeeping ---------------------------------------------
    def record(self, hit: bool) -> None:
        """Count a hit or a miss: one appended byte, never a lock."""
        self._bump("hits" if hit else "misses")

    def record_miss(self, key: CacheKey) -> None:
        """Keep the key of a miss so ``torchloom cache explain`` can compare it later."""
        if self.off is not None or not self._dir.is_dir():
            return
        record = json.dumps({"time": time.time(), "key": key.to_json()}).encode()
        try:
            self._ensure_dir(self._misses)
            self._atomic_write(("misses",), f"{key.digest}.json", record)
            with self._opened("misses") as misses:
                records = []
                for item in os.scandir(misses):
                    if item.name.endswith(".json") and item.is_file(follow_symlinks=False):
                        records.append((item.stat(follow_symlinks=False).st_mtime, item.name))
                for _, old in sorted(records)[:-_MAX_MISS_RECORDS]:
                    _unlink_at(misses, old)
        except OSError as exc:  # explanations are best effort
            log.debug("loom cache: could not record the miss: %s", exc)

    def misses(self) -> list[tuple[float, CacheKey]]:
        out = []
        try:
            with self._opened("misses") as misses:
                for item in os.scandir(misses):
                    if not item.name.endswith(".json"):
                        continue
                    try:
                        data = json.loads(_read_regular(misses, item.name))
                        out.append((float(data["time"]), CacheKey.from_json(data["key"])))
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
        except OSError:
            return []
        return sorted(out, key=lambda t: t[0])

    def stats(self) -> StoreStats:
        """Entries and bytes from one directory scan (no entry is read) and the
        counters: those folded into ``stats.json`` plus the journals not yet folded."""
        entries, size = self._total()
        counters = self._read_json(self._stats)
        pending = {c: 0 for c in _COUNTERS}
        with contextlib.suppress(OSError), self._opened("tmp") as tmp:
            for item in os.scandir(tmp):
                kind = item.name.rsplit(".", 1)[-1]
                if item.name.startswith("fold.") and kind in pending:
                    pending[kind] += item.stat(follow_symlinks=False).st_size
        with contextlib.suppress(OSError), self._opened() as layout:
            for c in _COUNTERS:
                with contextlib.suppress(OSError):
                    pending[c] += _stat(layout, f"{c}.count").st_size
        return StoreStats(
            entries=entries,
            bytes=size,
            hits=int(counters.get("hits", 0)) + pending["hits"],
            misses=int(counters.get("misses", 0)) + pending["misses"],
            corrupt=int(counters.get("corrupt", 0)) + pending["corrupt"],
            max_bytes=self.max_bytes,
        )

    def _bump(self, counter: str) -> None:
        if self.off is not None:
            return
        try:
            self._append(f"{counter}.count", b".")
        except OSError as exc:  # counters are best effort
            log.debug("loom cache: could not count a %s: %s", counter, exc)

    def _read_json(self, path: Path) -> dict[str, Any]:
        """The object in ``path`` (a file of the layout directory), or ``{}``."""
        try:
            with self._opened() as layout:
                data = json.loads(_read_regular(layout, path.name))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_json(self, path: Path, value: dict[str, Any]) -> None:
        self._atomic_write((), path.name, json.dumps(value).encode(), sync=False)

    # -- locks ---------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, lock: filelock.FileLock, timeout: float) -> Iterator[None]:
        """Hold ``lock``, waiting at most ``timeout`` (``filelock.Timeout`` past it)."""
        self._check_lock(lock)
        with lock.acquire(timeout=timeout):
            yield

    def _check_lock(self, lock: filelock.FileLock) -> None:
        """The lock file is a regular file or absent, in a layout directory reached
        through no symlink. NOTE: filelock opens it by path, so a swap between this
        check and that open is not caught; the lock file holds nothing of value."""
        name = os.path.basename(lock.lock_file)
        with self._opened() as layout, contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(_stat(layout, name).st_mode):
                raise UnsafeStoreError(
                    errno.ELOOP,
                    f"{lock.lock_file} is not a regular file (a symlink?); not followed",
                )

    @contextlib.contextmanager
    def _try_locked(self, lock: filelock.FileLock) -> Iterator[bool]:
        """Hold ``lock`` if it is free right now; yields whether it is held."""
        try:
            self._check_lock(lock)
            lock.acquire(timeout=0)
        except (OSError, filelock.Timeout):
            yield False
            return
        try:
            yield True
        finally:
            lock.release()


def _tmp_name(name: str) -> str:
    return f"{name}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex}.tmp"


def _writer_gone(name: str, age_s: float) -> bool:
    """Whether the temporary ``name`` (``_tmp_name``'s) was left by a dead writer. Its
    name says this host and a pid: the writer is gone when that pid is, however young
    the file, and alive while it lives, however old (a very slow put of a large entry).
    When the owner cannot be known (another host, a name not of this form, a pid no
    process can have), it is gone once older than :data:`_STALE_TMP_SECONDS`."""
    pid = _local_writer(name)
    if pid is None:
        return age_s > _STALE_TMP_SECONDS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's live process
        return False
    return False


def _local_writer(name: str) -> int | None:
    """The pid of this host's writer that ``name`` names, or None (owner unknown)."""
    parts = name.rsplit(".", 3)
    host, _, pid = parts[1].rpartition("-") if len(parts) == 4 else ("", "", "")
    if host != _HOST or not (pid.isascii() and pid.isdigit()) or os.name != "posix":
        return None  # NOTE: os.kill(pid, 0) ends the process on Windows
    # NOTE: 0 signals the process group; past pid_t, os.kill raises OverflowError
    return int(pid) if 0 < int(pid) <= _MAX_PID else None


def _symlink_refused(path: Path) -> UnsafeStoreError:
    return UnsafeStoreError(
        errno.ELOOP,
        f"{path} is a symlink; loom never follows a symlink inside its store "
        "(remove it, or point TORCHLOOM_CACHE_DIR elsewhere)",
    )


def _check_dir(st: os.stat_result, shown: Path) -> None:
    """``st`` (an ``lstat``) is a real directory's."""
    if stat.S_ISLNK(st.st_mode):
        raise _symlink_refused(shown)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{shown} is not a directory")


@contextlib.contextmanager
def _subdir(where: _Where, name: str, shown: Path) -> Iterator[_Where]:
    """The directory ``name`` in ``where``, never through a symlink (``shown``: its
    path, for messages)."""
    if not isinstance(where, int):  # pragma: no cover - no dir_fd
        path = os.path.join(where, name)
        _check_dir(os.lstat(path), shown)
        yield path
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=where)
    except OSError as exc:
        # NOTE: O_NOFOLLOW | O_DIRECTORY on a symlink is ENOTDIR on Linux, ELOOP elsewhere
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _check_dir(os.stat(name, dir_fd=where, follow_symlinks=False), shown)
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def _open_in(where: _Where, name: str, flags: int, mode: int = 0o600) -> int:
    if isinstance(where, int):
        return os.open(name, flags, mode, dir_fd=where)
    return os.open(os.path.join(where, name), flags, mode)  # pragma: no cover - no dir_fd


def _replace(src_where: _Where, src: str, dst_where: _Where, dst: str) -> None:
    if isinstance(src_where, int) and isinstance(dst_where, int):
        os.replace(src, dst, src_dir_fd=src_where, dst_dir_fd=dst_where)
    else:  # pragma: no cover - no dir_fd
        os.replace(os.path.join(str(src_where), src), os.path.join(str(dst_where), dst))


def _touch(where: _Where, name: str) -> None:
    if isinstance(where, int):
        os.utime(name, dir_fd=where, follow_symlinks=False)
    else:  # pragma: no cover - no dir_fd
        os.utime(os.path.join(where, name), follow_symlinks=False)


def _read_regular(where: _Where, name: str) -> bytes:
    """The bytes of the regular file ``name`` (never through a symlink)."""
    fd = _open_in(where, name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UnsafeStoreError(errno.EINVAL, f"{name} is not a regular file")
        return f.read()


def _check_regular(path: Path) -> None:
    """``path`` is a regular file or absent: never a symlink loom would follow."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStoreError(
            errno.ELOOP, f"{path} is not a regular file (a symlink?); not followed"
        )


def _sum_lines(where: _Where, name: str) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for line in _read_regular(where, name).splitlines():
            with contextlib.suppress(ValueError):
                total += int(line)
    return total


def _stat(where: _Where, name: str) -> os.stat_result:
    if isinstance(where, int):
        return os.stat(name, dir_fd=where, follow_symlinks=False)
    return os.lstat(os.path.join(where, name))  # pragma: no cover - no dir_fd


def _unlink_at(where: _Where, name: str) -> None:
    if isinstance(where, int):
        os.unlink(name, dir_fd=where)
    else:  # pragma: no cover - no dir_fd
        os.unlink(os.path.join(where, name))


def _unlink(where: _Where, name: str) -> None:
    """Unlink an entry (eviction, ``clear``, ``delete``)."""
    _unlink_at(where, name)


def _regular_size(where: _Where, name: str) -> int:
    try:
        st = _stat(where, name)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _read_info(where: _Where, name: str) -> EntryInfo | None:
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
