"""Cache keys you can explain (canonical graph fingerprints, stable symbol names,
hook fingerprints, configuration and versions), artifact stores (an embedded
local store, Redis for a fleet) and hit/miss explanations.

Example::

    fp = graph_fingerprint(gm)
    if fp.cacheable:
        key = make_key("model.py:forward#0", fp, device="cpu",
                       backend=("loom", "0.1.0"), options={"cudagraphs": False})
        store = open_default_store()          # CacheConfig.from_env(), resolved once
        found = store.lookup(key.digest)      # verified before the payload is handed out
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# NOTE: names load on first use (PEP 562): the ``torchloom cache`` commands (stats,
# list, clear) read the store without importing torch, which the keys' fingerprints
# and environment components need.
if TYPE_CHECKING:
    from loom_cache._bypass import CacheBypass, CacheBypassKind
    from loom_cache._cli import cache_main
    from loom_cache._config import (
        ENVIRONMENT_VARIABLES,
        CacheConfig,
        CacheConfigError,
        parse_size,
        redact_url,
    )
    from loom_cache._entry import (
        FORMAT_VERSION,
        MAGIC,
        Entry,
        EntryError,
        decode_entry,
        encode_entry,
    )
    from loom_cache._environment import (
        backend_component,
        device_component,
        environment_components,
        options_component,
        versions_component,
    )
    from loom_cache._fingerprint import USER_CACHE_HASH, Fingerprint, graph_fingerprint
    from loom_cache._hashing import UnhashableValue, function_digest, stable_digest
    from loom_cache._key import CacheKey, ComponentDiff, KeyComponent, explain_miss, nearest_key
    from loom_cache._local import LocalStore, default_cache_dir
    from loom_cache._make_key import code_component, make_key
    from loom_cache._redis import RedisStore
    from loom_cache._store import (
        CommandRefused,
        EntryInfo,
        Lookup,
        PutResult,
        Store,
        StoreStats,
        StoreUnavailable,
    )
    from loom_cache._symbols import stable_symbol_names, symbol_id
    from loom_cache._tiered import TieredStore, open_default_store

_LAZY: dict[str, str] = {
    **dict.fromkeys(("CacheBypass", "CacheBypassKind"), "loom_cache._bypass"),
    "cache_main": "loom_cache._cli",
    **dict.fromkeys(
        ("CacheConfig", "CacheConfigError", "ENVIRONMENT_VARIABLES", "parse_size", "redact_url"),
        "loom_cache._config",
    ),
    **dict.fromkeys(
        ("Entry", "EntryError", "FORMAT_VERSION", "MAGIC", "decode_entry", "encode_entry"),
        "loom_cache._entry",
    ),
    **dict.fromkeys(
        (
            "backend_component",
            "device_component",
            "environment_components",
            "options_component",
            "versions_component",
        ),
        "loom_cache._environment",
    ),
    **dict.fromkeys(
        ("Fingerprint", "USER_CACHE_HASH", "graph_fingerprint"), "loom_cache._fingerprint"
    ),
    **dict.fromkeys(("UnhashableValue", "function_digest", "stable_digest"), "loom_cache._hashing"),
    **dict.fromkeys(
        ("CacheKey", "ComponentDiff", "KeyComponent", "explain_miss", "nearest_key"),
        "loom_cache._key",
    ),
    **dict.fromkeys(("LocalStore", "default_cache_dir"), "loom_cache._local"),
    **dict.fromkeys(("code_component", "make_key"), "loom_cache._make_key"),
    "RedisStore": "loom_cache._redis",
    **dict.fromkeys(
        (
            "CommandRefused",
            "EntryInfo",
            "Lookup",
            "PutResult",
            "Store",
            "StoreStats",
            "StoreUnavailable",
        ),
        "loom_cache._store",
    ),
    **dict.fromkeys(("stable_symbol_names", "symbol_id"), "loom_cache._symbols"),
    **dict.fromkeys(("TieredStore", "open_default_store"), "loom_cache._tiered"),
}

# NOTE: type checkers see only the imports above, so an unknown name imported from
# this package is an error there, not an ``Any``.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "ENVIRONMENT_VARIABLES",
    "FORMAT_VERSION",
    "MAGIC",
    "USER_CACHE_HASH",
    "CacheBypass",
    "CacheBypassKind",
    "CacheConfig",
    "CacheConfigError",
    "CacheKey",
    "CommandRefused",
    "ComponentDiff",
    "Entry",
    "EntryError",
    "EntryInfo",
    "Fingerprint",
    "KeyComponent",
    "LocalStore",
    "Lookup",
    "PutResult",
    "RedisStore",
    "Store",
    "StoreStats",
    "StoreUnavailable",
    "TieredStore",
    "UnhashableValue",
    "__version__",
    "backend_component",
    "cache_main",
    "code_component",
    "decode_entry",
    "default_cache_dir",
    "device_component",
    "encode_entry",
    "environment_components",
    "explain_miss",
    "function_digest",
    "graph_fingerprint",
    "make_key",
    "nearest_key",
    "open_default_store",
    "options_component",
    "parse_size",
    "redact_url",
    "stable_digest",
    "stable_symbol_names",
    "symbol_id",
    "versions_component",
]
