"""Entry encoding: every kind of damage is detected and named."""

from __future__ import annotations

import json

import pytest

from loom_cache import MAGIC, CacheKey, Entry, EntryError, KeyComponent, decode_entry, encode_entry


def _entry(payload: bytes = b"artifact-bytes") -> Entry:
    return Entry(CacheKey("prog", (KeyComponent("graph", "a" * 64, "g"),)), payload, (("k", "v"),))


def test_round_trip() -> None:
    entry = _entry()
    back = decode_entry(encode_entry(entry))
    assert back.key == entry.key and back.payload == entry.payload and back.meta == entry.meta


@pytest.mark.parametrize("cut", [3, 12, 40, -1])
def test_truncated_entries_are_refused(cut: int) -> None:
    data = encode_entry(_entry())
    with pytest.raises(EntryError, match=r"truncated|magic"):
        decode_entry(data[:cut])


def test_flipped_payload_byte_fails_the_checksum() -> None:
    data = bytearray(encode_entry(_entry()))
    data[-1] ^= 0xFF
    with pytest.raises(EntryError, match="checksum"):
        decode_entry(bytes(data))


def test_other_format_version_is_refused() -> None:
    data = encode_entry(_entry()).replace(b'"format": 2', b'"format": 9')
    with pytest.raises(EntryError, match="format 9"):
        decode_entry(data)


def test_header_key_that_does_not_match_its_digest_is_refused() -> None:
    data = encode_entry(_entry())
    tampered = data.replace(b"a" * 64, b"b" * 64, 1)
    with pytest.raises(EntryError, match="digest"):
        decode_entry(tampered)


def test_entry_under_the_wrong_digest_is_refused() -> None:
    with pytest.raises(EntryError, match="not"):
        decode_entry(encode_entry(_entry()), expected_digest="f" * 64)


def test_header_is_plain_json() -> None:
    data = encode_entry(_entry())
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    assert header["format"] == 2 and header["key"]["program"] == "prog"
