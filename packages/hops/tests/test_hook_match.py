"""Hook pairs match by content: code, defaults, bound self, closure values or the traces' guards."""

from __future__ import annotations

from typing import Any

import hook_modules as hm
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import loom_hops
from loom_hops import HookDifference, HookPair, pair_mismatch
from loom_hops._hook_match import same_value


def _save_on_cpu() -> HookPair:
    hooks = torch.autograd.graph.save_on_cpu(device_type="cpu")
    return HookPair(hooks.pack_hook, hooks.unpack_hook)


def _traced(pair: HookPair) -> Any:
    """The pair's hook graphs after tracing it at one saved tensor, as placement does."""
    graphs = loom_hops.prepare_saved_tensors_hooks(pair)
    assert not isinstance(graphs, loom_hops.Unsupported)
    with FakeTensorMode():
        saved = torch.randn(4, 4)
    pack = graphs.trace_pack(saved)
    assert isinstance(pack, loom_hops.TracedPack)
    assert not isinstance(graphs.trace_unpack(pack, saved), loom_hops.Unsupported)
    return graphs


def _scaled(factor: float, limit: int = 0) -> HookPair:
    """A pack that reads ``factor`` only for tensors above ``limit`` elements."""

    def pack(t: torch.Tensor) -> Any:
        if t.numel() > limit:
            return t * factor
        return t * 1

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    return HookPair(pack, unpack)


def test_save_on_cpu_made_anew_matches_by_content_not_identity() -> None:
    a, b = _save_on_cpu(), _save_on_cpu()
    assert a.pack is not b.pack
    assert pair_mismatch(a, b) is None
    assert pair_mismatch(a, b, _traced(a)) is None


def test_other_code_differs_and_names_both_hooks() -> None:
    a, b = _scaled(2.0), HookPair(lambda t: t * 2.0, lambda t: t)
    found = pair_mismatch(a, b)
    assert found is not None and found.difference is HookDifference.CODE
    assert found.hook == "pack" and "pack at" in found.detail and "<lambda> at" in found.detail


def test_untraced_pairs_compare_every_closure_value() -> None:
    found = pair_mismatch(_scaled(2.0), _scaled(3.0))
    assert found is not None and found.difference is HookDifference.CLOSURE
    assert "factor: 2.0 vs 3.0" in found.detail
    assert pair_mismatch(_scaled(2.0), _scaled(2.0)) is None


def test_traced_pairs_ignore_closure_values_the_trace_never_read() -> None:
    # 16 elements are not above 100: the trace never reads `factor`.
    compiled = _scaled(2.0, limit=100)
    graphs = _traced(compiled)
    assert pair_mismatch(compiled, _scaled(3.0, limit=100), graphs) is None
    found = pair_mismatch(compiled, _scaled(2.0, limit=8), graphs)
    assert found is not None and found.difference is HookDifference.TRACED_VALUE
    assert "limit" in found.detail


def test_a_closure_float_the_graph_reads_is_an_input_and_only_its_type_differs() -> None:
    compiled = _scaled(2.0)
    graphs = _traced(compiled)
    assert pair_mismatch(compiled, _scaled(3.0), graphs) is None  # a graph input
    found = pair_mismatch(compiled, _scaled(3), graphs)  # type: ignore[arg-type]
    assert found is not None and found.difference is HookDifference.TRACED_VALUE
    assert "factor" in found.detail and "float" in found.detail


def test_a_number_the_pack_returns_is_folded_into_the_unpack_and_guarded() -> None:
    def make(scale: float) -> HookPair:
        def pack(t: torch.Tensor) -> Any:
            return (t * scale, scale)

        return HookPair(pack, lambda p: p[0] / p[1])

    compiled = make(2.0)
    graphs = _traced(compiled)
    found = pair_mismatch(compiled, make(4.0), graphs)
    assert found is not None and found.difference is HookDifference.TRACED_VALUE
    assert "scale" in found.detail and "== 2.0" in found.detail


def test_a_closure_value_a_branch_read_differs() -> None:
    def make(threshold: float) -> HookPair:
        def pack(t: torch.Tensor) -> Any:
            return t * 2 if threshold > 1.0 else t * 1

        return HookPair(pack, lambda t: t)

    compiled = make(2.0)
    graphs = _traced(compiled)
    assert pair_mismatch(compiled, make(3.0), graphs) is not None  # decided the branch


def test_defaults_and_bound_self_are_content() -> None:
    def make(dtype: torch.dtype) -> HookPair:
        def pack(t: torch.Tensor, dtype: torch.dtype = dtype) -> Any:
            return (t.dtype, t.to(dtype))

        return HookPair(pack, lambda p: p[1].to(p[0]))

    found = pair_mismatch(make(torch.bfloat16), make(torch.float16))
    assert found is not None and found.difference is HookDifference.DEFAULTS

    class Offload:
        def pack(self, t: torch.Tensor) -> Any:
            return t

        def unpack(self, t: torch.Tensor) -> torch.Tensor:
            return t

    one, two = Offload(), Offload()
    assert pair_mismatch(HookPair(one.pack, one.unpack), HookPair(one.pack, one.unpack)) is None
    found = pair_mismatch(HookPair(one.pack, one.unpack), HookPair(two.pack, two.unpack))
    assert found is not None and found.difference is HookDifference.SELF


def test_presence_and_kind() -> None:
    assert pair_mismatch(None, None) is None
    found = pair_mismatch(None, _save_on_cpu())
    assert found is not None and found.difference is HookDifference.PRESENCE
    found = pair_mismatch(_save_on_cpu(), HookPair(*hm.bf16()))
    assert found is not None and found.difference is HookDifference.KIND


def test_graph_module_pairs_match_by_graph() -> None:
    a, b = HookPair(*hm.bf16()), HookPair(*hm.bf16())
    assert a.pack is not b.pack and pair_mismatch(a, b) is None
    found = pair_mismatch(a, HookPair(*hm.fp8()))
    assert found is not None and found.difference is HookDifference.GRAPH


def _counting(stats: dict[str, int]) -> HookPair:
    def pack(t: torch.Tensor) -> Any:
        stats["packed"] += 1
        return t * 1

    def unpack(t: torch.Tensor) -> torch.Tensor:
        stats["unpacked"] += 1
        return t

    return HookPair(pack, unpack)


def test_unpack_effects_on_another_object_differ_pack_effects_do_not() -> None:
    """Pack effects replay on the state of the pair active at the call; the backward
    cannot tell which forward's pair it serves, so unpack effects need the same objects."""
    shared = {"packed": 0, "unpacked": 0}
    compiled = _counting(shared)
    graphs = _traced(compiled)
    assert pair_mismatch(compiled, _counting(shared), graphs) is None
    found = pair_mismatch(compiled, _counting({"packed": 0, "unpacked": 0}), graphs)
    assert found is not None and found.difference is HookDifference.EFFECT_TARGET

    def pack_only(log: list[int]) -> HookPair:
        def pack(t: torch.Tensor) -> Any:
            log.append(1)
            return t * 1

        return HookPair(pack, lambda t: t)

    first: list[int] = []
    compiled = pack_only(first)
    graphs = _traced(compiled)
    assert pair_mismatch(compiled, pack_only([]), graphs) is None


def test_pack_effects_replay_on_the_pair_given() -> None:
    first: dict[str, int] = {"packed": 0, "unpacked": 0}
    compiled = _counting(first)
    graphs = loom_hops.prepare_saved_tensors_hooks(compiled)
    assert not isinstance(graphs, loom_hops.Unsupported)
    with FakeTensorMode():
        saved = torch.randn(4, 4)
    pack = graphs.trace_pack(saved)
    assert isinstance(pack, loom_hops.TracedPack) and pack.effects is not None
    second: dict[str, int] = {"packed": 0, "unpacked": 0}
    pack.effects(_counting(second))
    assert first["packed"] == 0 and second["packed"] == 1


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (1, 1, True),
        (1, True, False),
        ((1, "x"), (1, "x"), True),
        (float("nan"), float("nan"), True),
        (torch.float32, torch.float32, True),
        (torch.zeros(2), torch.ones(2), True),  # tensors by metadata
        (torch.zeros(2), torch.zeros(3), False),
        ([1], [1], False),  # mutable objects by identity
    ],
)
def test_captured_values_compare_by_content(a: Any, b: Any, same: bool) -> None:
    assert same_value(a, b) is same
