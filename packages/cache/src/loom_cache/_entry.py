"""The on-disk (and on-wire) format of one cache entry.

An entry is ``MAGIC``, a 4-byte header length, a JSON header (format
version, the key with all its components, payload length and sha256, free
metadata, namespace, and which key signed it, if any), the payload bytes and,
for a signed entry, a 32-byte HMAC-SHA256 over everything before it. Decoding
checks every one of these, so a truncated, corrupted, forged, foreign or
version-mismatched entry is reported as :class:`EntryError` with a reason,
never returned. The signature is checked before anything else of the entry is
used: the payload (a pickle, for the umbrella) of an entry that fails it is
never handed out.

A payload is ``bytes``, or the ``bytearray`` a remote read filled in place:
entries are encoded as parts (head, payload, trailer) so a large payload is
hashed, signed and written without a copy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, Final

from loom_cache._config import key_id
from loom_cache._key import CacheKey

MAGIC: Final = b"LOOMCACHE\x00"
FORMAT_VERSION: Final = 2
MAC_BYTES: Final = 32
_HEADER_LEN_BYTES: Final = 4


class EntryError(ValueError):
    """An entry that cannot be used; the message says why (logged as a miss)."""


class ForeignEntry(EntryError):
    """An entry signed with a key this reader does not hold: another key holder's (a
    fleet sharing the store, a process after a rotation), not a corrupt one. Stores
    skip it and never delete it; eviction may."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A key, the artifact bytes stored under it, and free-form metadata."""

    key: CacheKey
    payload: bytes | bytearray
    meta: tuple[tuple[str, str], ...] = ()
    created: float = field(default_factory=time.time)

    @property
    def digest(self) -> str:
        return self.key.digest


def encode_parts(
    entry: Entry, *, key: bytes | None = None, namespace: str = ""
) -> tuple[bytes, bytes]:
    """The entry's head (magic, length, header) and trailer (the HMAC-SHA256 with
    ``key``, or nothing): the encoded entry is head + ``entry.payload`` + trailer,
    computed without copying the payload."""
    header = {
        "format": FORMAT_VERSION,
        "digest": entry.key.digest,
        "key": entry.key.to_json(),
        "payload_bytes": len(entry.payload),
        "payload_sha256": hashlib.sha256(entry.payload).hexdigest(),
        "meta": [list(kv) for kv in entry.meta],
        "created": entry.created,
        "namespace": namespace,
        "signed_by": key_id(key) if key is not None else None,
    }
    raw = json.dumps(header, sort_keys=True).encode()
    head = MAGIC + len(raw).to_bytes(_HEADER_LEN_BYTES, "little") + raw
    if key is None:
        return head, b""
    mac = hmac.new(key, head, hashlib.sha256)
    mac.update(entry.payload)
    return head, mac.digest()


def encode_entry(entry: Entry, *, key: bytes | None = None, namespace: str = "") -> bytes:
    """The entry's bytes; signed with ``key`` (HMAC-SHA256) when one is given."""
    head, trailer = encode_parts(entry, key=key, namespace=namespace)
    return b"".join((head, entry.payload, trailer))


def decode_header(data: bytes | bytearray) -> tuple[dict[str, Any], int]:
    """The header of an encoded entry and the offset of its payload."""
    if not data.startswith(MAGIC):
        raise EntryError("not a loom cache entry (bad magic)")
    start = len(MAGIC) + _HEADER_LEN_BYTES
    if len(data) < start:
        raise EntryError("truncated before the header")
    length = int.from_bytes(data[len(MAGIC) : start], "little")
    if len(data) < start + length:
        raise EntryError("truncated inside the header")
    try:
        header = json.loads(data[start : start + length])
    except ValueError as exc:
        raise EntryError(f"corrupt header: {exc}") from None
    if not isinstance(header, dict):
        raise EntryError("corrupt header: not an object")
    if header.get("format") != FORMAT_VERSION:
        raise EntryError(
            f"entry format {header.get('format')!r} does not match this loom_cache's "
            f"format {FORMAT_VERSION}"
        )
    return header, start + length


def _verify(
    head: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    trailer: bytes | bytearray | memoryview,
    header: dict[str, Any],
    keys: tuple[bytes, ...],
    required: bool,
) -> bool:
    """Whether the entry's signature was verified; raises when it must be and is not.

    ``required``: an unsigned entry is refused. A signed entry is verified with the
    key it names among ``keys`` (current and previous); an entry signed with a key
    this reader does not hold is refused when ``required`` (it cannot be checked)."""
    signed_by = header.get("signed_by")
    size = header.get("payload_bytes")
    if not isinstance(size, int) or size < 0:
        raise EntryError("corrupt header: no payload length")
    if len(payload) != size or len(trailer) != (MAC_BYTES if signed_by is not None else 0):
        raise EntryError(f"truncated payload: {len(payload)} of {size} bytes")
    if signed_by is None:
        if required:
            raise EntryError("unsigned entry refused (entries must be signed with the cache key)")
        return False
    key = next((k for k in keys if key_id(k) == signed_by), None)
    if key is None:
        if required:
            raise ForeignEntry(f"signed with key {signed_by!r}, which this reader does not hold")
        return False
    mac = hmac.new(key, head, hashlib.sha256)
    mac.update(payload)
    if not hmac.compare_digest(mac.digest(), bytes(trailer)):
        raise EntryError("signature mismatch (a forged or altered entry)")
    return True


def decode_entry(
    data: bytes,
    expected_digest: str | None = None,
    *,
    keys: tuple[bytes, ...] = (),
    require_signature: bool = False,
    namespace: str | None = None,
) -> Entry:
    """The entry in ``data``. With ``require_signature``, only an entry signed by one
    of ``keys`` decodes; ``namespace``: the entry must have been written in it."""
    return decode_checked(data, expected_digest, keys, require_signature, namespace)[0]


def decode_checked(
    data: bytes | bytearray,
    expected_digest: str | None,
    keys: tuple[bytes, ...],
    require_signature: bool,
    namespace: str | None,
) -> tuple[Entry, bool]:
    """:func:`decode_entry`, and whether its signature was verified."""
    header, offset = decode_header(data)
    size = header.get("payload_bytes")
    if not isinstance(size, int) or size < 0:
        raise EntryError("corrupt header: no payload length")
    trailer = MAC_BYTES if header.get("signed_by") is not None else 0
    if len(data) != offset + size + trailer:
        raise EntryError(f"truncated payload: {len(data) - offset - trailer} of {size} bytes")
    end = offset + size
    with memoryview(data) as view:  # NOTE: no copy of a large entry for its MAC
        verified = _verify(
            view[:offset], view[offset:end], view[end:], header, keys, require_signature
        )
        payload = bytes(view[offset:end])
    return _checked(header, payload, expected_digest, namespace), verified


def decode_parts(
    head: bytes | bytearray,
    payload: bytes | bytearray,
    trailer: bytes | bytearray,
    expected_digest: str | None,
    keys: tuple[bytes, ...],
    require_signature: bool,
    namespace: str | None,
) -> tuple[Entry, bool]:
    """:func:`decode_checked` of ``head + payload + trailer``, kept apart: a reader that
    filled the payload's own buffer hands it over, and the entry holds it uncopied."""
    header, offset = decode_header(head)
    if offset != len(head):
        raise EntryError("corrupt entry: bytes between the header and the payload")
    verified = _verify(head, payload, trailer, header, keys, require_signature)
    return _checked(header, payload, expected_digest, namespace), verified


def _checked(
    header: dict[str, Any],
    payload: bytes | bytearray,
    expected_digest: str | None,
    namespace: str | None,
) -> Entry:
    """The entry, once everything but its signature (already checked) is checked."""
    if namespace is not None and header.get("namespace", "") != namespace:
        raise EntryError(f"entry of namespace {header.get('namespace')!r}, not {namespace!r}")
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise EntryError("payload checksum mismatch (corrupted entry)")
    try:
        key = CacheKey.from_json(header["key"])
        meta = tuple((str(k), str(v)) for k, v in header.get("meta", []))
        created = float(header.get("created", 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryError(f"corrupt header: {exc!r}") from None
    if key.digest != header.get("digest"):
        raise EntryError("key digest does not match its components (corrupted entry)")
    if expected_digest is not None and key.digest != expected_digest:
        raise EntryError(f"entry holds key {key.digest[:12]}, not {expected_digest[:12]}")
    return Entry(key, payload, meta, created)
