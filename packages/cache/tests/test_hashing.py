"""Content hashing: equal in every process, sensitive to what changes behaviour."""

from __future__ import annotations

import pytest
import torch

from loom_cache import UnhashableValue, function_digest, stable_digest


def _make(k: float):  # type: ignore[no-untyped-def]
    def hook(t: torch.Tensor) -> torch.Tensor:
        return t * k

    return hook


def test_closure_contents_change_the_function_digest() -> None:
    assert function_digest(_make(2.0)) == function_digest(_make(2.0))
    assert function_digest(_make(2.0)) != function_digest(_make(3.0))


def test_function_body_changes_the_digest_but_its_location_does_not() -> None:
    namespace: dict[str, object] = {}
    exec("def f(x):\n    return x + 1\n", namespace)
    exec("\n\n\ndef g(x):\n    return x + 1\n", namespace)
    exec("def h(x):\n    return x + 2\n", namespace)
    f, g, h = namespace["f"], namespace["g"], namespace["h"]
    g.__qualname__ = "f"  # type: ignore[attr-defined]
    assert function_digest(f) == function_digest(g)  # type: ignore[arg-type]
    assert function_digest(f) != function_digest(h)  # type: ignore[arg-type]


def test_referenced_globals_enter_the_digest() -> None:
    namespace: dict[str, object] = {"K": 1}
    exec("def f(x):\n    return x + K\n", namespace)
    before = function_digest(namespace["f"])  # type: ignore[arg-type]
    namespace["K"] = 2
    assert function_digest(namespace["f"]) != before  # type: ignore[arg-type]


def test_small_tensors_hash_by_content_and_large_by_metadata() -> None:
    assert stable_digest(torch.zeros(3)) != stable_digest(torch.ones(3))
    assert stable_digest(torch.zeros(10_000)) == stable_digest(torch.ones(10_000))
    assert stable_digest(torch.zeros(3)) != stable_digest(torch.zeros(3, dtype=torch.float64))


def test_dict_insertion_order_does_not_matter() -> None:
    assert stable_digest({"a": 1, "b": 2}) == stable_digest({"b": 2, "a": 1})
    assert stable_digest([1, 2]) != stable_digest((1, 2))


def test_objects_without_content_raise_unless_they_carry_a_cache_hash() -> None:
    lock = __import__("threading").Lock()
    with pytest.raises(UnhashableValue, match="cache_hash"):
        stable_digest(lock)

    class Handle:
        __slots__ = ("cache_hash",)

        def __init__(self, h: str) -> None:
            self.cache_hash = h

    assert stable_digest(Handle("v1")) != stable_digest(Handle("v2"))


def test_recursive_functions_and_cyclic_containers_terminate() -> None:
    def fact(n: int) -> int:
        return 1 if n <= 1 else n * fact(n - 1)

    cyclic: list[object] = [1]
    cyclic.append(cyclic)
    assert function_digest(fact) == function_digest(fact)
    assert stable_digest(cyclic) == stable_digest(cyclic)


def test_plain_values_keep_their_pinned_digest() -> None:
    """The digest of settings-like values is part of every stored key: a faster path
    for plain types must write exactly what the general one wrote."""
    value = {"b": [1, (2.0, None)], "a": 1, "c": True, "d": {"x": "y"}, "e": b"z", "f": 3.5}
    pinned = "d25e5d2bdff552732f2a34a4d69421de2980261f840c4537e6ea13fc7f4963a5"
    assert stable_digest(value) == pinned
    assert stable_digest(dict(reversed(list(value.items())))) == pinned
    assert stable_digest([value, value]) == stable_digest([dict(value), dict(value)])
