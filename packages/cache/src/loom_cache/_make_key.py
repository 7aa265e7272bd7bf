"""Assemble the key of one compiled graph from all that changes its result.

``make_key`` joins the graph fingerprint's components, the environment
(versions, device, configuration, numerics), the backend's identity and
options, and the code the artifact depends on without the graph showing it
(hooks, custom-op implementations passed in by the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from loom_cache._bypass import CacheBypass, CacheBypassKind
from loom_cache._environment import backend_component, environment_components, options_component
from loom_cache._fingerprint import Fingerprint
from loom_cache._hashing import UnhashableValue, describe_callable, function_digest
from loom_cache._key import CacheKey, KeyComponent


def code_component(
    name: str, functions: Sequence[Callable[..., Any]]
) -> KeyComponent | CacheBypass:
    """A component for code the artifact depends on (hooks, custom-op bodies),
    or a bypass when one of them closes over something with no stable hash."""
    digests = []
    for fn in functions:
        try:
            digests.append(function_digest(fn))
        except UnhashableValue as exc:
            return CacheBypass(
                CacheBypassKind.UNHASHABLE_CLOSURE,
                describe_callable(fn),
                str(exc),
                "give the captured object a `cache_hash` string attribute, or capture "
                "plain values (numbers, strings, tensors, functions)",
            )
    detail = ", ".join(describe_callable(fn).split(" (")[0] for fn in functions)
    return KeyComponent(name, _join(digests), detail or "none")


def make_key(
    program: str,
    fingerprint: Fingerprint,
    *,
    device: torch.device | str,
    backend: tuple[str, str],
    options: Mapping[str, object],
    extra: Sequence[KeyComponent] = (),
) -> CacheKey:
    """The full key: graph components + environment + backend + options + extra.

    ``backend`` is ``(name, version)``; ``extra`` holds caller components such
    as the :func:`code_component` of the active hooks.
    """
    components = (
        *fingerprint.components,
        KeyComponent(
            "symbols",
            _join([f"{n}={s}" for n, s in fingerprint.symbols]),
            ", ".join(f"{n}={s}" for n, s in fingerprint.symbols) or "static",
        ),
        *environment_components(device),
        backend_component(*backend),
        options_component(options),
        *extra,
    )
    key = CacheKey(program, components)
    key.check()
    return key


def _join(parts: Sequence[str]) -> str:
    from loom_cache._hashing import stable_digest

    return stable_digest(list(parts))
