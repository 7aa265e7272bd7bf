"""The on-disk (and on-wire) format of one cache entry.

An entry is ``MAGIC``, a 4-byte header length, a JSON header (format
version, the key with all its components, payload length and sha256, free
metadata) and the payload bytes. Decoding checks every one of these, so a
truncated, corrupted or version-mismatched entry is reported as
:class:`EntryError` with a reason, never returned.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Final

from loom_cache._key import CacheKey

MAGIC: Final = b"LOOMCACHE\x00"
FORMAT_VERSION: Final = 1
_HEADER_LEN_BYTES: Final = 4


class EntryError(ValueError):
    """An entry that cannot be used; the message says why (logged as a miss)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A key, the artifact bytes stored under it, and free-form metadata."""

    key: CacheKey
    payload: bytes
    meta: tuple[tuple[str, str], ...] = ()
    created: float = field(default_factory=time.time)

    @property
    def digest(self) -> str:
        return self.key.digest


def encode_entry(entry: Entry) -> bytes:
    header = {
        "format": FORMAT_VERSION,
        "digest": entry.key.digest,
        "key": entry.key.to_json(),
        "payload_bytes": len(entry.payload),
        "payload_sha256": hashlib.sha256(entry.payload).hexdigest(),
        "meta": [list(kv) for kv in entry.meta],
        "created": entry.created,
    }
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(raw).to_bytes(_HEADER_LEN_BYTES, "little") + raw + entry.payload


def decode_header(data: bytes) -> tuple[dict[str, Any], int]:
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


def decode_entry(data: bytes, expected_digest: str | None = None) -> Entry:
    header, offset = decode_header(data)
    payload = data[offset:]
    if len(payload) != header.get("payload_bytes"):
        raise EntryError(
            f"truncated payload: {len(payload)} of {header.get('payload_bytes')} bytes"
        )
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
