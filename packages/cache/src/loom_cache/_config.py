"""The cache's environment variables, validated where they are read, once.

Every ``TORCHLOOM_CACHE_*`` / ``TORCHLOOM_REMOTE_CACHE*`` variable is read here
and nowhere else: :func:`CacheConfig.from_env` resolves them into one frozen
:class:`CacheConfig` that the stores are built from. A bad value never fails a
compile and never passes silently: it is logged as a WARNING naming the
variable and the value (never a secret), and the default is used. URLs reach
messages only through :func:`redact_url`, so a password never appears in a log
line or an error; keys never appear at all (``repr`` leaves them out).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal
from urllib.parse import unquote, unquote_plus

log = logging.getLogger("torchloom.cache")

DEFAULT_MAX_BYTES: Final = 2 << 30
DEFAULT_TIMEOUT_S: Final = 0.5
DEFAULT_RETRY_AFTER_S: Final = 30.0
DEFAULT_REMOTE_MAX_BYTES: Final = 128 << 20
#: The bounds of every numeric setting, checked where it is parsed (a value past one
#: warns and uses the default): a remote call may wait up to 10 minutes (a socket
#: timeout near 1e10 s overflows the platform's time_t), the breaker may stay open up
#: to a day, and a size may reach 1 PiB.
MAX_TIMEOUT_S: Final = 600.0
MAX_RETRY_AFTER_S: Final = 86400.0
MAX_SIZE_BYTES: Final = 1 << 50
#: The most a key file may hold (a key is a line of text; a few keys fit many times).
KEY_FILE_MAX_BYTES: Final = 4096
_UNITS: Final = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
# NOTE: [0-9], not \d: \d and float() take any Unicode digit (fullwidth, Arabic-Indic).
_SIZE: Final = re.compile(r"\s*([0-9]+)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)
_SECONDS: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*")
#: Query parameters whose values never enter a message (``?password=...``, ``ssl_password``).
_SECRET_PARAM: Final = re.compile(r"pass|secret|token|auth|cred|key", re.IGNORECASE)
#: The shortest piece of a password that :func:`redact` hides on its own.
_MIN_FRAGMENT: Final = 6
#: Where the host ends for urllib and redis-py.
_HOST_END: Final = re.compile(r"[/?#]")
_NAMESPACE: Final = re.compile(r"[A-Za-z0-9_.\-]{0,64}")
_MIN_KEY_BYTES: Final = 16
#: C0 and C1 controls and Unicode line breaks: in a setting they could forge a log line.
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: Keys are bytes, never logged: any byte may be in one.
_KEY_VARIABLES: Final = frozenset({"TORCHLOOM_CACHE_KEY", "TORCHLOOM_CACHE_PREVIOUS_KEY"})
#: How often :meth:`CacheConfig.from_env` looks at the key file again: a rotation
#: (or a key file that appears) is picked up within this many seconds.
KEY_FILE_RECHECK_S: Final = 60.0
_monotonic = time.monotonic
_stamps_lock = threading.Lock()
#: Key file path -> (when it was last looked at, what its stat said).
_stamps: dict[str, tuple[float, tuple[int, ...] | None]] = {}

Trust = Literal["signed", "unsigned"]
Mode = Literal["private", "shared"]

#: Every variable :meth:`CacheConfig.from_env` reads (the docs list each one).
VARIABLES: Final = (
    "TORCHLOOM_CACHE_DIR",
    "TORCHLOOM_CACHE_MAX_BYTES",
    "TORCHLOOM_CACHE_MODE",
    "TORCHLOOM_CACHE_KEY",
    "TORCHLOOM_CACHE_KEY_FILE",
    "TORCHLOOM_CACHE_PREVIOUS_KEY",
    "TORCHLOOM_CACHE_NAMESPACE",
    "TORCHLOOM_REMOTE_CACHE",
    "TORCHLOOM_REMOTE_CACHE_TIMEOUT",
    "TORCHLOOM_REMOTE_CACHE_RETRY_AFTER",
    "TORCHLOOM_REMOTE_CACHE_TRUST",
    "TORCHLOOM_REMOTE_CACHE_MAX_BYTES",
)
#: The same, by the name ``loom_cache`` exports it under.
ENVIRONMENT_VARIABLES: Final = VARIABLES


class CacheConfigError(ValueError):
    """A cache setting that cannot be used (raised by :class:`CacheConfig` only for
    values given in code; environment values warn and fall back instead)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """The cache's settings, resolved once (``CacheConfig.from_env()``) and passed
    to the stores. Secrets stay out of ``repr``: the keys are never shown and the
    remote URL is shown redacted.

    >>> CacheConfig(Path("/tmp/c")).signing
    False
    """

    #: The local tier's directory (``TORCHLOOM_CACHE_DIR``).
    dir: Path = dataclasses.field(default_factory=lambda: _default_dir({}))
    #: The local tier's size bound in bytes; 0 stores nothing (``TORCHLOOM_CACHE_MAX_BYTES``).
    max_bytes: int = DEFAULT_MAX_BYTES
    #: ``private``: files 0600, directories 0700; ``shared``: group-writable
    #: (0660 / 2770) for a cache shared by a group (``TORCHLOOM_CACHE_MODE``).
    mode: Mode = "private"
    #: HMAC keys, the current one first, then previous ones still accepted when read.
    keys: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)
    #: Prefix that separates tenants sharing one Redis (``TORCHLOOM_CACHE_NAMESPACE``).
    namespace: str = ""
    #: ``redis://...`` of the fleet tier, or ``None`` (``TORCHLOOM_REMOTE_CACHE``).
    remote_url: str | None = dataclasses.field(default=None, repr=False)
    #: Overall deadline of one remote call: connect, send and receive together.
    remote_timeout_s: float = DEFAULT_TIMEOUT_S
    #: After a remote failure, the remote tier is skipped for this long (circuit breaker).
    remote_retry_after_s: float = DEFAULT_RETRY_AFTER_S
    #: ``signed``: the remote tier serves only entries signed with one of ``keys``;
    #: ``unsigned``: it also serves unsigned entries (explicit opt-in, warned once).
    remote_trust: Trust = "signed"
    #: The largest value one remote read accepts (``TORCHLOOM_REMOTE_CACHE_MAX_BYTES``):
    #: a larger entry is a miss for that key, and the remote tier does not store one.
    remote_max_bytes: int = DEFAULT_REMOTE_MAX_BYTES
    #: Why no configured key can be used (``TORCHLOOM_CACHE_KEY_FILE`` missing or not a
    #: small regular file, a key shorter than 16 bytes), or None. Set, the cache fails
    #: closed: every tier refuses every entry and stores nothing (docs/cache.md, "Trust").
    key_missing: str | None = None

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise CacheConfigError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.remote_max_bytes <= 0:
            raise CacheConfigError(f"remote_max_bytes must be > 0, got {self.remote_max_bytes}")
        if self.mode not in ("private", "shared"):
            raise CacheConfigError(f"mode must be 'private' or 'shared', got {self.mode!r}")
        if self.remote_trust not in ("signed", "unsigned"):
            raise CacheConfigError(
                f"remote_trust must be 'signed' or 'unsigned', got {self.remote_trust!r}"
            )
        if not _NAMESPACE.fullmatch(self.namespace):
            raise CacheConfigError(f"namespace {self.namespace!r}: up to 64 of A-Z a-z 0-9 _ . -")
        for key in self.keys:
            if len(key) < _MIN_KEY_BYTES:
                raise CacheConfigError(f"a cache key needs at least {_MIN_KEY_BYTES} bytes")
        for name, most in (
            ("remote_timeout_s", MAX_TIMEOUT_S),
            ("remote_retry_after_s", MAX_RETRY_AFTER_S),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= most):
                raise CacheConfigError(f"{name} must be in (0, {most}] seconds, got {value!r}")
        for name in ("max_bytes", "remote_max_bytes"):
            if getattr(self, name) > MAX_SIZE_BYTES:
                raise CacheConfigError(f"{name} must be at most {MAX_SIZE_BYTES} bytes")

    @property
    def signing(self) -> bool:
        """Whether entries are signed and every tier refuses unsigned ones."""
        return bool(self.keys)

    @property
    def refuses_unsigned(self) -> bool:
        """Whether the local tier refuses unsigned entries: a key is set, or a configured
        key file is missing (fail closed)."""
        return bool(self.keys) or self.key_missing is not None

    @property
    def remote_url_redacted(self) -> str | None:
        return None if self.remote_url is None else redact_url(self.remote_url)

    @property
    def remote_requires_signature(self) -> bool:
        """The remote tier serves only entries signed with one of ``keys``."""
        return self.remote_trust == "signed"

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(key_id(k) for k in self.keys)

    def describe(self) -> str:
        """One line for logs and ``torchloom cache stats`` (no secret in it)."""
        keys = f"{len(self.keys)} key(s) {', '.join(self.key_ids)}" if self.keys else "no key"
        if self.key_missing is not None:
            keys = f"refusing every entry ({self.key_missing})"
        remote = self.remote_url_redacted or "off"
        return (
            f"dir={self.dir} max_bytes={self.max_bytes} mode={self.mode} signing={keys} "
            f"namespace={self.namespace or '-'} remote={remote} trust={self.remote_trust} "
            f"timeout={self.remote_timeout_s}s retry_after={self.remote_retry_after_s}s "
            f"remote_max_bytes={self.remote_max_bytes}"
        )

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> CacheConfig:
        """The configuration the environment describes; each distinct setting is
        resolved (and warned about) once per process."""
        env = os.environ if env is None else env
        stamp = _key_file_stamp(env.get("TORCHLOOM_CACHE_KEY_FILE"))
        return _resolve(
            tuple((name, env.get(name)) for name in VARIABLES) + _dir_base(env) + (stamp,)
        )


def key_id(key: bytes) -> str:
    """A short public name of a key (entries say which key signed them)."""
    return hashlib.sha256(b"torchloom-cache-key-id\x00" + key).hexdigest()[:12]


def parse_size(text: str) -> int:
    """A byte count: a plain integer, or one with a binary suffix.

    ``K``/``M``/``G``/``T`` (also ``KiB``, ``KB``, any case) multiply by powers of 1024.
    Fractions, exponents (``1e9``), negative numbers, digits other than ASCII ones and
    sizes past :data:`MAX_SIZE_BYTES` (1 PiB) are refused.

    >>> parse_size("512M"), parse_size("1GiB"), parse_size("100")
    (536870912, 1073741824, 100)
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size (an integer, optionally with K, M, G or T: 512M, 1G)"
        )
    size = int(match.group(1)) << (10 * _UNITS[(match.group(2) or "").upper()])
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"{text!r} is past the largest size, {MAX_SIZE_BYTES} bytes (1 PiB)")
    return size


def _key_file_stamp(raw: str | None) -> tuple[str, str | None]:
    """What the key file's stat says (identity, size, mtime), looked at again at most
    every :data:`KEY_FILE_RECHECK_S`: a changed stamp resolves the settings afresh, so a
    process started before a rotation reads the new key instead of deleting, or
    refusing, what new processes sign with it."""
    path = (raw or "").strip()
    if not path:
        return ("key file stamp", None)
    now = _monotonic()
    with _stamps_lock:
        seen = _stamps.get(path)
        if seen is None or now - seen[0] >= KEY_FILE_RECHECK_S:
            try:
                st = os.stat(path)
                found: tuple[int, ...] | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                found = None
            seen = _stamps[path] = (now, found)
    return ("key file stamp", repr(seen[1]))


def _dir_base(env: Mapping[str, str]) -> tuple[tuple[str, str | None], ...]:
    return (("XDG_CACHE_HOME", env.get("XDG_CACHE_HOME")), ("HOME", env.get("HOME")))


def _default_dir(env: Mapping[str, str | None]) -> Path:
    explicit = env.get("TORCHLOOM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchloom"


def _warn(var: str, raw: str, why: str, default: object) -> None:
    log.warning("loom cache: ignoring %s=%r: %s; using %s", var, raw, why, default)


def _max_bytes(raw: str | None) -> int:
    raw = (raw or "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = parse_size(raw)
    except ValueError as exc:
        _warn("TORCHLOOM_CACHE_MAX_BYTES", raw, str(exc), f"the default {DEFAULT_MAX_BYTES} bytes")
        return DEFAULT_MAX_BYTES
    if value == 0:
        log.warning("loom cache: TORCHLOOM_CACHE_MAX_BYTES=0: the local tier stores nothing")
    return value


def _remote_max_bytes(raw: str | None) -> int:
    raw = (raw or "").strip()
    default = DEFAULT_REMOTE_MAX_BYTES
    if not raw:
        return default
    try:
        value = parse_size(raw)
    except ValueError as exc:
        _warn("TORCHLOOM_REMOTE_CACHE_MAX_BYTES", raw, str(exc), f"the default {default} bytes")
        return default
    if value == 0:
        _warn(
            "TORCHLOOM_REMOTE_CACHE_MAX_BYTES", raw, "must be > 0", f"the default {default} bytes"
        )
        return default
    return value


def _seconds(var: str, raw: str | None, default: float, most: float) -> float:
    raw = (raw or "").strip()
    if not raw:
        return default
    value = float(raw) if _SECONDS.fullmatch(raw) else math.nan
    if not (0 < value <= most):
        why = f"not a number of seconds in (0, {most:g}] written with ASCII digits"
        _warn(var, raw, why, f"the default {default} s")
        return default
    return value


def _choice(var: str, raw: str | None, choices: tuple[str, ...]) -> str:
    value = (raw or "").strip().lower()
    if not value:
        return choices[0]
    if value not in choices:
        _warn(var, value, f"expected one of {', '.join(choices)}", choices[0])
        return choices[0]
    return value


_FILE_KINDS: Final = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


class _NotASecret(Exception):
    """A key file that is not a small regular file (what it is, in words)."""


def _read_secret(path: str) -> tuple[bytes, int]:
    """The bytes of a small regular file (a symlink to one is followed) and its mode.

    Opened with ``O_NONBLOCK`` so a FIFO without a writer cannot block, checked with
    ``fstat`` before any read (a device, a FIFO, a directory is refused unread), and
    read up to :data:`KEY_FILE_MAX_BYTES` plus one byte, whatever its size claims."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise _NotASecret(f"it is {kind}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= KEY_FILE_MAX_BYTES:
            chunk = os.read(fd, KEY_FILE_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > KEY_FILE_MAX_BYTES:
        raise _NotASecret(f"it holds more than the {KEY_FILE_MAX_BYTES} bytes a key file may")
    return b"".join(chunks), mode


def _key_file(path: str) -> tuple[list[bytes], str | None]:
    """The keys of a key file, and why it cannot be used (None: it can)."""
    try:
        data, mode = _read_secret(path)
    except _NotASecret as exc:
        return [], str(exc)
    except OSError as exc:
        return [], exc.strerror or type(exc).__name__
    lines = [ln.strip() for ln in data.splitlines()]
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        what = (
            "written and read"
            if mode & stat.S_IWOTH and mode & stat.S_IROTH
            else ("written" if mode & stat.S_IWOTH else "read")
        )
        log.warning(
            "loom cache: TORCHLOOM_CACHE_KEY_FILE=%r can be %s by every user (mode %o): "
            "anyone who reads it can sign entries that run code here; chmod 600 it",
            path,
            what,
            stat.S_IMODE(mode),
        )
    keys = [ln for ln in lines if ln and not ln.startswith(b"#")]
    if not keys:
        log.warning(
            "loom cache: TORCHLOOM_CACHE_KEY_FILE=%r holds no key (%s): entries are not signed",
            path,
            "only comments" if any(lines) else "it is empty",
        )
    return keys, None


def _keys(env: Mapping[str, str | None]) -> tuple[tuple[bytes, ...], str | None]:
    """Current key first, previous ones after, and why a configured key cannot be used
    (None when every one can). Keys are the variables' bytes (hex or any string of 16+
    bytes); a key file holds one key per line, the current one first.

    A configured key that cannot be used (a key file missing or not a small regular
    file, a key shorter than 16 bytes) leaves the others in use with a WARNING; with
    none left, the cache fails closed (one ERROR)."""
    configured: list[tuple[str, bytes]] = []
    problems: list[str] = []
    set_vars: list[str] = []
    for var in ("TORCHLOOM_CACHE_KEY", "TORCHLOOM_CACHE_KEY_FILE", "TORCHLOOM_CACHE_PREVIOUS_KEY"):
        raw = (env.get(var) or "").strip()
        if not raw:
            continue
        set_vars.append(var)
        if var != "TORCHLOOM_CACHE_KEY_FILE":
            configured.append((var, _env_bytes(raw)))
            continue
        if _CONTROL.search(raw):
            problems.append(
                f"TORCHLOOM_CACHE_KEY_FILE={raw!r} holds a control character (a newline, a "
                "carriage return, an escape), which could forge a log line; it is not read"
            )
            continue
        from_file, why = _key_file(raw)
        configured.extend((var, key) for key in from_file)
        if why is not None:
            problems.append(f"TORCHLOOM_CACHE_KEY_FILE={raw!r} cannot be read: {why}")
    usable: list[bytes] = []
    for var, key in configured:
        if len(key) < _MIN_KEY_BYTES:
            # NOTE: not even the key's id: a short key's id can be searched for it
            problems.append(
                f"{var} holds a key of {len(key)} bytes; a key needs at least {_MIN_KEY_BYTES}"
            )
        elif key not in usable:
            usable.append(key)
    if not problems:
        return tuple(usable), None
    missing = "; ".join(problems)
    if not usable:
        # NOTE: fail closed. A key was configured, so this process was meant to trust
        # only signed entries; trusting unsigned ones because the key cannot be used
        # would let anyone who can write the store run code here.
        log.error(
            "loom cache: %s; the cache refuses every entry and stores nothing until a "
            "usable key is set (unset %s to run without signing)",
            missing,
            " and ".join(set_vars),
        )
        return (), missing
    log.warning("loom cache: %s; using the other keys set", missing)
    return tuple(usable), None


def _env_bytes(value: str) -> bytes:
    """The bytes of an environment value as the process received them: ``os.environ``
    decodes them with ``surrogateescape``, so a key that is not UTF-8 (``head -c 32
    /dev/urandom``) comes back whole instead of raising ``UnicodeEncodeError``."""
    return os.fsencode(value)


def _namespace(raw: str | None) -> str:
    value = (raw or "").strip()
    if not _NAMESPACE.fullmatch(value):
        _warn("TORCHLOOM_CACHE_NAMESPACE", value, "up to 64 of A-Z a-z 0-9 _ . -", "no namespace")
        return ""
    return value


def _without_controls(items: tuple[tuple[str, str | None], ...]) -> dict[str, str | None]:
    """The settings, each one holding a control character refused with a WARNING that
    quotes it (``%r``): treated as unset, but for the key file, which fails closed."""
    env = dict(items)
    for var in VARIABLES:
        value = (env.get(var) or "").strip()
        if var in _KEY_VARIABLES or not _CONTROL.search(value):
            continue
        if var == "TORCHLOOM_CACHE_KEY_FILE":
            continue  # NOTE: refused in _keys, where a refused key file fails closed
        shown = redact_url(value) if var == "TORCHLOOM_REMOTE_CACHE" else value
        log.warning(
            "loom cache: ignoring %s=%r: it holds a control character (a newline, a "
            "carriage return, an escape), which could forge a log line; it is treated as "
            "unset",
            var,
            shown,
        )
        env[var] = None
    return env


@functools.cache
def _resolve(items: tuple[tuple[str, str | None], ...]) -> CacheConfig:
    env = _without_controls(items)
    url = (env.get("TORCHLOOM_REMOTE_CACHE") or "").strip() or None
    trust = _choice(
        "TORCHLOOM_REMOTE_CACHE_TRUST",
        env.get("TORCHLOOM_REMOTE_CACHE_TRUST"),
        ("signed", "unsigned"),
    )
    keys, key_missing = _keys(env)
    config = CacheConfig(
        dir=_default_dir(env),
        max_bytes=_max_bytes(env.get("TORCHLOOM_CACHE_MAX_BYTES")),
        mode=_choice(
            "TORCHLOOM_CACHE_MODE", env.get("TORCHLOOM_CACHE_MODE"), ("private", "shared")
        ),  # type: ignore[arg-type]
        keys=keys,
        namespace=_namespace(env.get("TORCHLOOM_CACHE_NAMESPACE")),
        remote_url=url,
        remote_timeout_s=_seconds(
            "TORCHLOOM_REMOTE_CACHE_TIMEOUT",
            env.get("TORCHLOOM_REMOTE_CACHE_TIMEOUT"),
            DEFAULT_TIMEOUT_S,
            MAX_TIMEOUT_S,
        ),
        remote_retry_after_s=_seconds(
            "TORCHLOOM_REMOTE_CACHE_RETRY_AFTER",
            env.get("TORCHLOOM_REMOTE_CACHE_RETRY_AFTER"),
            DEFAULT_RETRY_AFTER_S,
            MAX_RETRY_AFTER_S,
        ),
        remote_trust=trust,  # type: ignore[arg-type]
        remote_max_bytes=_remote_max_bytes(env.get("TORCHLOOM_REMOTE_CACHE_MAX_BYTES")),
        key_missing=key_missing,
    )
    if url is not None and key_missing is None and url_problem(url) is None:
        if trust == "unsigned":
            log.warning(
                "loom cache: TORCHLOOM_REMOTE_CACHE_TRUST=unsigned: the remote tier serves "
                "unsigned entries; anyone who can write %s can run code in this process",
                redact_url(url),
            )
        elif not keys:
            log.warning(
                "loom cache: the remote tier %s is off: no cache key is set and it serves "
                "only signed entries. Set TORCHLOOM_CACHE_KEY (or TORCHLOOM_CACHE_KEY_FILE) "
                "to the fleet's key, or TORCHLOOM_REMOTE_CACHE_TRUST=unsigned to trust "
                "every writer of that server",
                redact_url(url),
            )
    return config


def timeout_from_env() -> float:
    """``TORCHLOOM_REMOTE_CACHE_TIMEOUT``, as :meth:`CacheConfig.from_env` reads it."""
    return CacheConfig.from_env().remote_timeout_s


@dataclasses.dataclass(frozen=True, slots=True)
class _Url:
    """A URL cut where a password cannot move the cut: the user part is everything
    between ``//`` and the *last* ``@`` (from the start when there is no ``//``)."""

    head: str  #: up to and including ``//``
    user: str | None  #: None: no ``@``
    password: str | None  #: None: no ``:`` in the user part
    rest: str  #: host, port, path, query
    #: An ``@`` lies past the end of the host as urllib and redis-py find it (the first
    #: ``/``, ``?`` or ``#``), other than in a secret query parameter's value
    #: (``?password=p@ss``): a raw one of those in the password, or an ``@`` in the
    #: path or query. Which part is the password cannot be told; the URL is unusable.
    ambiguous: bool


def _cut(url: str) -> _Url:
    slashes = url.find("//")
    start = slashes + 2 if slashes >= 0 else 0
    at = url.rfind("@", start)
    match = _HOST_END.search(url, start)
    host_end = len(url) if match is None else match.start()
    ambiguous = at > host_end
    if ambiguous and _only_in_secret_values(url, host_end):
        at, ambiguous = url.rfind("@", start, host_end), False  # as urllib cuts it
    if at < 0:
        return _Url(url[:start], None, None, url[start:], False)
    user, colon, password = url[start:at].partition(":")
    return _Url(url[:start], user, password if colon else None, url[at + 1 :], ambiguous)


def _only_in_secret_values(url: str, host_end: int) -> bool:
    """Whether every ``@`` past ``host_end`` lies in the value of a secret query
    parameter (``?password=p@ss``, read as such by urllib and redis-py)."""
    question = url.find("?", host_end)
    if question < 0 or "#" in url[host_end:question]:
        return False
    inside: set[int] = set()
    pos = question + 1
    for item in url[question + 1 :].split("&"):
        name, eq, value = item.partition("=")
        if eq and _SECRET_PARAM.search(unquote_plus(name)):
            first = pos + len(name) + 1
            inside.update(range(first, first + len(value)))
        pos += len(item) + 1
    return all(i in inside for i in range(host_end, len(url)) if url[i] == "@")


def _query_secrets(rest: str) -> tuple[str, list[str]]:
    """``rest`` with the value of its first secret query parameter, and everything
    after it, replaced by ``***``; and the values redis-py would read there."""
    before, question, query = rest.partition("?")
    if not question:
        return rest, []
    kept: list[str] = []
    for item in query.split("&"):
        name, eq, value = item.partition("=")
        if eq and _SECRET_PARAM.search(unquote_plus(name)):
            # NOTE: to the end: a raw '&' or '#' in the value cannot cut it short
            tail = query[len("&".join([*kept, name])) + 1 :]
            kept.append(f"{name}=***")
            return f"{before}?{'&'.join(kept)}", [value, tail]
        kept.append(item)
    return rest, []


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be used safely (None: nothing this module sees). An ``@``
    past the host's end is one: a raw ``/``, ``?`` or ``#`` in a password moves the
    password out of the part every parser treats as the user part."""
    cut = _cut(url)
    if cut.ambiguous:
        return (
            "an '@' comes after the end of the host: a raw '/', '?' or '#' in the "
            "password (or an '@' in the path or query) makes the URL ambiguous; "
            "percent-encode them (%2F, %3F, %23, %40)"
        )
    if any(c in f"{cut.user}{cut.password}" for c in "[]"):
        return (
            "a raw '[' or ']' in the user name or password (urllib takes it for an IPv6 "
            "address); percent-encode them (%5B, %5D)"
        )
    return None


def _secrets(url: str) -> set[str]:
    """Every password ``url`` carries, as written and as redis-py decodes it."""
    cut = _cut(url)
    found: set[str] = set()
    if cut.ambiguous:  # the whole user part, and a query as urllib would find it
        found.add(url[len(cut.head) : len(url) - len(cut.rest) - 1])
        found.update(_query_secrets(url[len(cut.head) :])[1])
    if cut.password:
        found.add(cut.password)
    found.update(_query_secrets(cut.rest)[1])
    return {form for s in found if s for form in (s, unquote(s), unquote_plus(s)) if form}


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***``: the user part's (everything
    between ``//`` and the last ``@``, so no character of a password moves it out of
    the part redacted) and a query parameter such as ``?password=`` (with the rest
    of the query). The user name, host, port and path stay. An ambiguous URL (see
    :func:`url_problem`) keeps only its scheme.

    >>> redact_url("redis://user:secret@host:6379/0")
    'redis://user:***@host:6379/0'
    >>> redact_url("redis://u:Hash#Secret@host:6379/0")  # ambiguous
    'redis://***'
    >>> redact_url("redis://host/0?db=1&password=secret")
    'redis://host/0?db=1&password=***'
    """
    cut = _cut(url)
    if cut.ambiguous:
        return f"{cut.head}***"
    user = ""
    if cut.user is not None:
        user = cut.user + (":***" if cut.password is not None else "") + "@"
    return cut.head + user + _query_secrets(cut.rest)[0]


def redact(text: str, url: str) -> str:
    """``text`` (say, an exception's message) with every password of ``url``, as
    written or decoded, and every run of :data:`_MIN_FRAGMENT` or more of its
    characters, replaced by ``***``."""
    secrets = sorted(_secrets(url), key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, "***")
    # NOTE: a parser that cut the URL inside a password quotes a piece of it
    for secret in secrets:
        for size in range(len(secret) - 1, _MIN_FRAGMENT - 1, -1):
            for start in range(len(secret) - size + 1):
                piece = secret[start : start + size]
                if piece in text:
                    text = text.replace(piece, "***")
    return text
