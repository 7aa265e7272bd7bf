"""Small modules that follow FSDP's pattern (zero-storage parameters gathered
in forward by resize + fill and freed after, gathered again for backward),
compiled through Dynamo and AOTAutograd with the resize passes and compared
with eager in outputs, gradients and every parameter's storage size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from resize_testing import RESIZE, Recorder, assert_same_steps, empty_param, targets, train_steps

from loom_resize import FillOp, FSDPPatternStack
from loom_resize import _torch_compat as compat

FILLS: tuple[FillOp, ...] = ("fsdp", "copy", "foreach")


def _compare(recorder: Recorder, fill: FillOp, device: str) -> list[Any]:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    eager_model = FSDPPatternStack(3, 16, fill=fill, device=device)
    want = train_steps(eager_model, eager_model, x)
    model = FSDPPatternStack(3, 16, fill=fill, device=device)
    compiled = torch.compile(model, backend=recorder.backend(), fullgraph=True)
    got = train_steps(model, compiled, x)
    assert_same_steps(got, want)
    assert want[0].nbytes_after_forward == (0, 0, 0)
    return got


@pytest.mark.parametrize("fill", FILLS)
def test_fsdp_pattern_matches_eager_and_gathers_no_full_parameter(
    recorder: Recorder, fill: FillOp
) -> None:
    _compare(recorder, fill, "cpu")
    forward = recorder.graphs["forward"]
    assert RESIZE not in targets(forward) and compat.fsdp_copy() not in targets(forward)
    # what the forward hands to backward includes the zero-storage parameters themselves
    saved = forward.graph.output_node().args[0]
    params = [n for n in forward.graph.nodes if n.op == "placeholder" and n.name in ("primals_1",)]
    assert params and params[0] in saved
    assert RESIZE not in targets(recorder.graphs["backward"])


def test_fsdp_pattern_without_chain_removal_matches_eager(recorder: Recorder) -> None:
    recorder.remove_chains = False
    _compare(recorder, "copy", "cpu")
    assert targets(recorder.graphs["forward"]).count(RESIZE) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("fill", FILLS)
def test_fsdp_pattern_matches_eager_on_cuda(recorder: Recorder, fill: FillOp) -> None:
    _compare(recorder, fill, "cuda")
    assert RESIZE not in targets(recorder.graphs["forward"])


def _alias_case(device: str = "cpu") -> None:
    param = torch.nn.Parameter(empty_param(4, 4).to(device))
    alias = param.view(16)  # stored by user code before the gather
    src = torch.randn(4, 4, device=device)

    def gather_and_use(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), compat.preserve_version_counter(param):
            param.untyped_storage().resize_(64)
            param.copy_(src)
        return x @ param

    recorder = Recorder()
    torch._dynamo.reset()
    x = torch.randn(2, 4, device=device, requires_grad=True)
    out = torch.compile(gather_and_use, backend=recorder.backend(), fullgraph=True)(x, src)
    torch.testing.assert_close(out, x @ src)
    assert param.untyped_storage().nbytes() == 64
    torch.testing.assert_close(alias, src.reshape(16))
    out.sum().backward()
    assert param.grad is not None and x.grad is not None
    torch.testing.assert_close(x.grad, src.sum(1).expand(2, 4))


def test_grown_parameter_is_an_input_mutation_visible_through_a_stored_alias() -> None:
    _alias_case()


def test_input_freed_in_the_graph_ends_with_zero_storage() -> None:
    param = torch.randn(4, 4)
    x = torch.randn(2, 4)
    expected = x @ param

    def use_and_free(x: torch.Tensor) -> torch.Tensor:
        out = x @ param
        param.untyped_storage().resize_(0)
        return out

    recorder = Recorder()
    torch._dynamo.reset()
    out = torch.compile(use_and_free, backend=recorder.backend(), fullgraph=True)(x)
    torch.testing.assert_close(out, expected)
    assert param.untyped_storage().nbytes() == 0


def test_reduce_grads_moves_each_gradient_into_its_shard_and_drops_it() -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    plain = FSDPPatternStack(3, 16, fill="copy")
    reducing = FSDPPatternStack(3, 16, fill="copy", reduce_grads=True)
    seen: list[list[bool]] = []
    for i, w in enumerate(reducing.weights):
        # registered first, so it runs before the reducing hook: every later
        # layer's gradient is already reduced and dropped
        w.register_post_accumulate_grad_hook(
            lambda p, i=i: seen.append([q.grad is not None for q in reducing.weights])
        )
    for model in (plain, reducing):
        for _ in range(2):
            out = model(x)
            model.prepare_backward(out)
            out.sum().backward()
    assert seen[:3] == [[False, False, True], [False, True, False], [True, False, False]]
    for i, w in enumerate(reducing.weights):
        assert w.grad is None
        assert plain.weights[i].grad is not None
        torch.testing.assert_close(reducing.grad_shard(i), plain.weights[i].grad)
    assert reducing.storage_nbytes() == [0, 0, 0]
