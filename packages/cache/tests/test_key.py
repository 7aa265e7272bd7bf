"""Keys: separation by backend, options and environment; explanations of misses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom_cache import (
    CacheBypassKind,
    CacheKey,
    KeyComponent,
    code_component,
    explain_miss,
    graph_fingerprint,
    make_key,
    nearest_key,
)


def _fp():  # type: ignore[no-untyped-def]
    return graph_fingerprint(torch.fx.symbolic_trace(lambda x: x + 1))


def _key(**overrides: object) -> CacheKey:
    args: dict[str, object] = {
        "device": "cpu",
        "backend": ("loom", "0.1.0"),
        "options": {"cudagraphs": False},
    }
    args.update(overrides)
    return make_key("prog", _fp(), **args)  # type: ignore[arg-type]


def test_same_inputs_give_the_same_key() -> None:
    assert _key().digest == _key().digest


def test_other_backend_or_options_never_share_a_key() -> None:
    digests = {
        _key().digest,
        _key(backend=("inductor", "2.11")).digest,
        _key(backend=("loom", "0.2.0")).digest,
        _key(options={"cudagraphs": True}).digest,
    }
    assert len(digests) == 4


def test_explain_names_the_changed_option() -> None:
    diffs = explain_miss(_key(options={"cudagraphs": True}), _key())
    assert [d.name for d in diffs] == ["options"]
    assert "cudagraphs: False -> True" in str(diffs[0])


def test_environment_changes_are_explained_by_name() -> None:
    before = _key()
    with torch._inductor.config.patch(max_autotune=True):
        after = _key()
    diffs = explain_miss(after, before)
    assert [d.name for d in diffs] == ["inductor_config"]
    assert "max_autotune: False -> True" in str(diffs[0])


def test_default_dtype_enters_the_key() -> None:
    before = _key()
    torch.set_default_dtype(torch.float64)
    try:
        after = _key()
    finally:
        torch.set_default_dtype(torch.float32)
    assert [d.name for d in explain_miss(after, before)] == ["numerics"]


def test_nearest_prefers_the_same_program() -> None:
    base = _key()
    other_program = dataclasses.replace(base, program="elsewhere")
    changed = _key(options={"cudagraphs": True})
    assert nearest_key(base, [other_program, changed]) is changed
    assert nearest_key(base, []) is None


def test_check_rejects_duplicate_or_malformed_components() -> None:
    good = KeyComponent("a", "0" * 64)
    with pytest.raises(ValueError, match="duplicate"):
        CacheKey("p", (good, good)).check()
    with pytest.raises(ValueError, match="malformed"):
        CacheKey("p", (KeyComponent("a", "xyz"),)).check()


def test_key_survives_a_json_round_trip() -> None:
    key = _key()
    assert CacheKey.from_json(key.to_json()) == key


def test_hook_code_component_changes_with_the_hook_and_bypasses_unhashable_closures() -> None:
    def make(k: float):  # type: ignore[no-untyped-def]
        return lambda t: t * k

    a, b = code_component("hooks", [make(1.0)]), code_component("hooks", [make(2.0)])
    assert isinstance(a, KeyComponent) and isinstance(b, KeyComponent)
    assert a.digest != b.digest
    lock = __import__("threading").Lock()
    bypass = code_component("hooks", [lambda t: (lock, t)[1]])
    assert not isinstance(bypass, KeyComponent)
    assert bypass.kind is CacheBypassKind.UNHASHABLE_CLOSURE
