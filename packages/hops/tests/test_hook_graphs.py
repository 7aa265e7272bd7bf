"""Tracing a hook graph never turns Dynamo's control-flow exceptions into a refusal."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import RestartAnalysis, SkipFrame

from loom_hops._hook_graphs import trace_pack_graph


@pytest.mark.parametrize("signal", [RestartAnalysis(), SkipFrame("skip")], ids=type)
def test_a_dynamo_signal_raised_while_tracing_a_pack_hook_propagates(
    signal: BaseException,
) -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        raise signal

    with pytest.raises(type(signal)):
        trace_pack_graph(pack, torch.randn(3), None)


def test_an_ordinary_error_while_tracing_a_pack_hook_is_a_refusal() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad hook")

    result = trace_pack_graph(pack, torch.randn(3), None)
    assert not isinstance(result, BaseException) and "bad hook" in str(result)
