"""The resize stage end to end: FSDP-style modules compiled with
``backend="loom"`` match eager in outputs, gradients and the storage size of
every parameter; refusals fall back to eager with the reason, or raise in
strict mode; ``torchloom.report()`` shows what the passes did."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import loom_resize
import torchloom
from loom_resize import FillOp, FSDPPatternStack

# NOTE: the cache stays off: a hit would replay another compilation's report entries.
EAGER = {"codegen": "eager", "cache": False}


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torchloom.reset()
    yield
    torchloom.reset()


def _steps(model: FSDPPatternStack, forward: Any, x: torch.Tensor, steps: int = 2) -> list[Any]:
    seen = []
    for _ in range(steps):
        x.grad = None
        for w in model.weights:
            w.grad = None
        out = forward(x)
        after_forward = model.storage_nbytes()
        model.prepare_backward(out)
        out.sum().backward()
        assert x.grad is not None
        grads = [w.grad.clone() for w in model.weights if w.grad is not None]
        seen.append((out.detach(), x.grad.clone(), grads, after_forward, model.storage_nbytes()))
    return seen


def _compare(
    fill: FillOp,
    options: dict[str, Any],
    device: str = "cpu",
    backend: Any = "loom",
    steps: int = 2,
) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    reference = FSDPPatternStack(2, 16, fill=fill, device=device)
    want = _steps(reference, reference, x, steps)
    model = FSDPPatternStack(2, 16, fill=fill, device=device)
    compiled = torch.compile(model, backend=backend, options=options, fullgraph=True)
    got = _steps(model, compiled, x, steps)
    for (o1, g1, w1, f1, b1), (o2, g2, w2, f2, b2) in zip(got, want, strict=True):
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(g1, g2)
        assert len(w1) == len(w2) == 2
        for a, b in zip(w1, w2, strict=True):
            torch.testing.assert_close(a, b)
        assert (f1, b1) == (f2, b2) == ([0, 0], [0, 0])
    assert torchloom.report()[0].fallback is None


def _messages(kind: str) -> list[str]:
    return [e.message for e in torchloom.report().entries("resize") if e.kind == kind]


@pytest.mark.parametrize("fill", ["fsdp", "copy", "foreach"])
def test_fsdp_pattern_compiles_and_matches_eager(fill: FillOp) -> None:
    _compare(fill, EAGER)
    removed = _messages("remove_resize_copy_resize")
    assert len(removed) == 2 and all(m.startswith("forward: input 'primals_") for m in removed)
    inputs = _messages("input")
    assert len(inputs) == 2 and all("up_down (0 -> 0 bytes" in m for m in inputs)
    if fill != "fsdp":
        assert len(_messages("rewrite_fills_as_fsdp_copy")) == 2
    forward_code = dict(torchloom.report()[0].graphs)["forward"]
    assert "resize_storage_bytes_" not in forward_code


@pytest.mark.parametrize("chains", [True, False], ids=["chains_removed", "chains_kept"])
@pytest.mark.parametrize("fill", ["fsdp", "copy", "foreach"])
def test_fsdp_pattern_under_cuda_graphs_matches_eager(fill: FillOp, chains: bool) -> None:
    """FSDP-style weights (storage freed between uses) in graphs run as CUDA graphs,
    with ``HostCapturer`` standing in on the CPU: outputs, gradients and every
    weight's storage size equal eager's over the warm-up, the recording and replays.
    With the chains kept, the captured graph reads weights whose storage holds no
    memory when the capture begins (the host stand-in crashed on them before)."""
    import loom_cudagraph

    capturer = loom_cudagraph.HostCapturer()
    backend = torchloom.Pipeline(capturer=capturer, cudagraph_device="cpu")
    options = {**EAGER, "cudagraphs": True, "resize_remove_chains": chains}
    _compare(fill, options, backend=backend, steps=4)
    assert capturer.captures >= 2 and capturer.replays >= 2
    segments = [e for e in torchloom.report().entries("cudagraph") if e.kind == "segment"]
    assert segments and all(e.get("captured") for e in segments)


def test_chain_removal_can_be_turned_off() -> None:
    _compare("copy", {**EAGER, "resize_remove_chains": False})
    assert not _messages("remove_resize_copy_resize")
    assert "resize_storage_bytes_" in dict(torchloom.report()[0].graphs)["forward"]


def _partial(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out = x @ p
    p.untyped_storage().resize_(32)
    return out


def test_partial_resize_falls_back_to_eager_with_the_reason() -> None:
    p, x = torch.randn(4, 4), torch.randn(2, 4)
    want = x @ p
    out = torch.compile(_partial, backend="loom", options=EAGER)(p, x)
    torch.testing.assert_close(out, want)
    assert p.untyped_storage().nbytes() == 32
    record = torchloom.report()[0]
    assert record.fallback is not None and "L['p']" in record.fallback
    assert "from 64 to 32 bytes" in record.fallback and "test_resize.py" in record.fallback
    # the package's own refusal is kept as typed data, not only as text
    assert record.refusal is not None and isinstance(record.refusal.cause, loom_resize.Unsupported)
    assert record.refusal.cause.kind is loom_resize.ResizeRefusalKind.PARTIAL_RESIZE
    assert [e.get("kind_") for e in torchloom.report().entries("resize")] == ["partial_resize"]


def test_partial_resize_raises_in_strict_mode() -> None:
    with pytest.raises(Exception, match=r"from 64 to 32 bytes"):
        torch.compile(_partial, backend="loom", options={**EAGER, "strict": True})(
            torch.randn(4, 4), torch.randn(2, 4)
        )


@pytest.mark.inductor
def test_fsdp_pattern_matches_eager_with_inductor_codegen() -> None:
    _compare("copy", {"codegen": "inductor", "cache": False})


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_fsdp_pattern_matches_eager_on_cuda(codegen: str) -> None:
    _compare("copy", {"codegen": codegen, "cache": False}, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("chains", [True, False], ids=["chains_removed", "chains_kept"])
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_fsdp_pattern_under_cuda_graphs_on_cuda(codegen: str, chains: bool) -> None:
    # CUDA graphs with the weights freed between uses: with the chains kept, the
    # captured graph itself allocates (resize), fills and frees each weight
    options = {"codegen": codegen, "cache": False, "cudagraphs": True}
    _compare("copy", {**options, "resize_remove_chains": chains}, device="cuda", steps=4)
    segments = [e for e in torchloom.report().entries("cudagraph") if e.kind == "segment"]
    assert segments and all(e.get("captured") for e in segments)


def test_same_parameter_reaching_the_graph_twice_is_one_input() -> None:
    def gather_then_read(
        x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, src: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            a.untyped_storage().resize_(64)
            a.copy_(src)
        out = x @ b  # b is a: the fill must be visible through it
        a.untyped_storage().resize_(0)
        return out

    def fresh() -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.randn(4, 4))
        p.untyped_storage().resize_(0)
        return p

    x, src = torch.randn(2, 4, requires_grad=True), torch.randn(4, 4)
    p_eager, p_loom = fresh(), fresh()
    want = gather_then_read(x, p_eager, p_eager, src)
    got = torch.compile(gather_then_read, backend="loom", options=EAGER, fullgraph=True)(
        x, p_loom, p_loom, src
    )
    torch.testing.assert_close(got, want)
    assert p_loom.untyped_storage().nbytes() == 0
    (record,) = torchloom.report()
    assert sum(1 for i in record.inputs if i.shape == ("4", "4")) == 2  # p once, src once
    assert len(_messages("remove_resize_copy_resize")) == 1


def test_call_whose_parameter_enters_with_storage_runs_eagerly() -> None:
    def gather_use_free(x: torch.Tensor, p: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p.untyped_storage().resize_(64)
            p.copy_(src)
        out = x @ p
        p.untyped_storage().resize_(0)
        return out

    compiled = torch.compile(gather_use_free, backend="loom", options=EAGER, fullgraph=True)
    x, src = torch.randn(2, 4), torch.randn(4, 4)
    empty = torch.randn(4, 4)
    empty.untyped_storage().resize_(0)
    torch.testing.assert_close(compiled(x, empty, src), x @ src)
    assert not _messages("guard_failed")
    full = torch.randn(4, 4)  # entered full: eager frees it at the end, so must we
    torch.testing.assert_close(compiled(x, full, src), x @ src)
    assert full.untyped_storage().nbytes() == 0
    (message,) = _messages("guard_failed")
    assert "entered with 64 bytes, compiled for 0" in message


def test_backward_gather_traced_by_compiled_autograd_loses_its_chains() -> None:
    import torch._dynamo.compiled_autograd as compiled_autograd

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
    reference = FSDPPatternStack(2, 16, fill="copy")
    want = _steps(reference, reference, x)
    model = FSDPPatternStack(2, 16, fill="copy")
    compiled = torch.compile(model, backend="loom", options=EAGER, fullgraph=True)
    backward_compiler = torch.compile(backend="loom", options=EAGER, fullgraph=True)
    with compiled_autograd._enable(backward_compiler):
        got = _steps(model, compiled, x)
    for (o1, g1, w1, f1, b1), (o2, g2, w2, f2, b2) in zip(got, want, strict=True):
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(g1, g2)
        for a, b in zip(w1, w2, strict=True):
            torch.testing.assert_close(a, b)
        assert (f1, b1) == (f2, b2)
    assert all(g.fallback is None for g in torchloom.report())
    # the compiled-autograd graph gets its weights as items of one list input
    removed = _messages("remove_resize_copy_resize")
    assert sum(m.startswith("inference: ") for m in removed) == 2
