"""Cache keys made of named components, each content-derived and explainable.

A :class:`CacheKey` is a tuple of :class:`KeyComponent` (name, digest, a short
human-readable detail) plus the ``program`` it was computed for. Its digest
hashes the names and digests of the components only, so two keys are equal
iff every component is. The components are stored with each entry, so a miss
can say which of them differ from the nearest stored entry of the same
program (:func:`explain_miss`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from loom_cache._hashing import stable_digest


@dataclass(frozen=True, slots=True)
class KeyComponent:
    """One named part of a key: ``digest`` decides hits, ``detail`` explains."""

    name: str
    digest: str
    detail: str = ""

    @staticmethod
    def of(name: str, value: object, detail: str | None = None) -> KeyComponent:
        """Component whose digest is the stable content hash of ``value``."""
        text = detail if detail is not None else _short(value)
        return KeyComponent(name, stable_digest(value), text)


@dataclass(frozen=True, slots=True)
class ComponentDiff:
    """A component that differs between a looked-up key and a stored one.

    ``stored`` / ``wanted`` are details, or ``None`` when the component exists
    on one side only.
    """

    name: str
    stored: str | None
    wanted: str | None

    def __str__(self) -> str:
        changed = _changed_settings(self.stored, self.wanted)
        if changed is not None:
            return f"{self.name}: {changed}"
        if self.stored is None:
            return f"{self.name}: new component ({self.wanted})"
        if self.wanted is None:
            return f"{self.name}: no longer present (was {self.stored})"
        if self.stored == self.wanted:
            return f"{self.name}: content differs ({self.wanted})"
        return f"{self.name}: {self.stored} -> {self.wanted}"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """The key of one compiled graph.

    ``program`` names what was compiled (e.g. ``model.py:12:forward#0``) so that a
    miss can be compared with earlier entries of the same program; it is not part
    of the digest.
    """

    program: str
    components: tuple[KeyComponent, ...]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for component in sorted(self.components, key=lambda c: c.name):
            h.update(f"{component.name}={component.digest};".encode())
        return h.hexdigest()

    def component(self, name: str) -> KeyComponent | None:
        for component in self.components:
            if component.name == name:
                return component
        return None

    def check(self) -> None:
        """Verifier: component names are unique and digests are sha256 hex."""
        names = [c.name for c in self.components]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"CacheKey has duplicate components: {duplicates}")
        for c in self.components:
            if len(c.digest) != 64 or any(ch not in "0123456789abcdef" for ch in c.digest):
                raise ValueError(f"CacheKey component {c.name!r} has a malformed digest")

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "components": [[c.name, c.digest, c.detail] for c in self.components],
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> CacheKey:
        components = tuple(
            KeyComponent(str(name), str(digest), str(detail))
            for name, digest, detail in data["components"]
        )
        return CacheKey(str(data["program"]), components)


def explain_miss(key: CacheKey, nearest: CacheKey) -> list[ComponentDiff]:
    """The components in which ``key`` differs from ``nearest`` (a stored key)."""
    stored = {c.name: c for c in nearest.components}
    wanted = {c.name: c for c in key.components}
    diffs = []
    for name in sorted(stored.keys() | wanted.keys()):
        old, new = stored.get(name), wanted.get(name)
        if old is not None and new is not None and old.digest == new.digest:
            continue
        diffs.append(
            ComponentDiff(
                name,
                old.detail if old is not None else None,
                new.detail if new is not None else None,
            )
        )
    return diffs


def nearest_key(key: CacheKey, candidates: Iterable[CacheKey]) -> CacheKey | None:
    """The candidate sharing the most components with ``key``, preferring the
    same program; ``None`` when there are no candidates."""

    def score(candidate: CacheKey) -> tuple[int, int]:
        same = {c.name: c.digest for c in candidate.components}
        shared = sum(1 for c in key.components if same.get(c.name) == c.digest)
        return (int(candidate.program == key.program), shared)

    best: CacheKey | None = None
    best_score = (-1, -1)
    for candidate in candidates:
        s = score(candidate)
        if s > best_score:
            best, best_score = candidate, s
    return best


def _short(value: object, limit: int = 120) -> str:
    try:
        text = json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def mapping_component(name: str, mapping: Mapping[str, object]) -> KeyComponent:
    """A component for a settings mapping; its detail is the JSON of the mapping,
    so an explanation can name the settings that changed."""
    items = dict(sorted(mapping.items()))
    return KeyComponent(name, stable_digest(items), json.dumps(items, sort_keys=True, default=str))


def _changed_settings(stored: str | None, wanted: str | None) -> str | None:
    if stored is None or wanted is None or not stored.startswith("{"):
        return None
    try:
        old, new = json.loads(stored), json.loads(wanted)
    except ValueError:
        return None
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    missing = object()
    parts = [
        f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k, missing) != new.get(k, missing)
    ]
    return "; ".join(parts) if parts else "content differs"
