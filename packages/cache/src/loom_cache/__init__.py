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

from loom_cache._bypass import CacheBypass, CacheBypassKind
from loom_cache._cli import cache_main
from loom_cache._config import VARIABLES as ENVIRONMENT_VARIABLES
from loom_cache._config import CacheConfig, CacheConfigError, parse_size, redact_url
from loom_cache._entry import FORMAT_VERSION, MAGIC, Entry, EntryError, decode_entry, encode_entry
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
