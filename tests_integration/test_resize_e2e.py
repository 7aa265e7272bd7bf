"""FSDP's parameter pattern on a small transformer, single process: every
parameter of each block has zero storage, the block's forward pre-hook
gathers them (resize up + fill from a shard) and its forward hook frees them;
backward gathers again. Compiled with ``backend="loom"`` it must match eager
in loss, gradients and every parameter's final storage size, and the forward
graph must not allocate the parameters' own storage."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchloom
from loom_resize import FSDPPatternStack
from loom_resize import _torch_compat as resize_compat


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def _shard_name(param_name: str) -> str:
    return "shard_" + param_name.replace(".", "_")


class Sharded:
    """Gives each block FSDP2's lifecycle: zero-storage parameters, gathered
    by a forward pre-hook, freed by a forward hook, gathered again for backward."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], fill: str) -> None:
        self.fill = fill
        self.blocks = blocks
        self.params = [p for blk in blocks for p in blk.parameters()]
        for blk in blocks:
            # NOTE: shards are buffers found by name: keying them by id(param) would
            # make Dynamo guard on the parameter's identity, and that guard prints
            # the parameter, which crashes on zero storage.
            for name, p in blk.named_parameters():
                blk.register_buffer(_shard_name(name), p.detach().clone())
            blk.register_forward_pre_hook(lambda m, _args: self.gather(m))
            blk.register_forward_hook(lambda m, _args, _out: self.free(list(m.parameters())))
        for p in self.params:
            p.untyped_storage().resize_(0)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda q: self.free([q]))

    def gather(self, module: nn.Module) -> None:
        names, params = zip(*module.named_parameters(), strict=True)
        gathered = [getattr(module, _shard_name(n)) * 1 for n in names]  # all-gather outputs
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for p in params:
                stack.enter_context(resize_compat.preserve_version_counter(p))
                p.untyped_storage().resize_(p.numel() * p.element_size())
            if self.fill == "foreach":
                resize_compat.foreach_copy_(list(params), gathered)
            else:
                for p, g in zip(params, gathered, strict=True):
                    p.copy_(g)

    def free(self, params: list[nn.Parameter]) -> None:
        for p in params:
            p.untyped_storage().resize_(0)

    def before_backward(self, loss: torch.Tensor) -> None:
        def gather_all(grad: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                self.gather(blk)
            return grad

        loss.register_hook(gather_all)

    def nbytes(self) -> list[int]:
        return [int(p.untyped_storage().nbytes()) for p in self.params]


def _model() -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    blocks = [Block(32, 4), Block(32, 4)]
    return nn.Sequential(*blocks), blocks


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torchloom.reset()
    torch._dynamo.reset()
    yield
    torchloom.reset()


def _train(
    compiled: bool,
    fill: str,
    options: dict[str, Any],
    device: str,
    steps: int = 3,
    dynamic: bool | None = None,
) -> list[Any]:
    model, blocks = _model()
    model.to(device)
    sharded = Sharded(model, blocks, fill)
    run = (
        torch.compile(model, backend="loom", options=options, fullgraph=True, dynamic=dynamic)
        if compiled
        else model
    )
    seen = []
    for step in range(steps):
        seq = 8 + 3 * step if dynamic else 8
        x = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(1)).to(device)
        for p in sharded.params:
            p.grad = None
        loss = run(x).square().mean()
        after_forward = sharded.nbytes()
        sharded.before_backward(loss)
        loss.backward()
        grads = [p.grad.clone() for p in sharded.params if p.grad is not None]
        seen.append((loss.detach(), grads, after_forward, sharded.nbytes()))
    return seen


def _check(
    fill: str, options: dict[str, Any], device: str = "cpu", dynamic: bool | None = None
) -> None:
    want = _train(False, fill, options, device, dynamic=dynamic)
    got = _train(True, fill, options, device, dynamic=dynamic)
    for (l1, g1, f1, b1), (l2, g2, f2, b2) in zip(got, want, strict=True):
        torch.testing.assert_close(l1, l2)
        assert len(g1) == len(g2) == 24
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert f1 == f2 and b1 == b2 and not any(f1) and not any(b1)
    assert [r.fallback for r in torchloom.report()] == [None] * len(torchloom.report())


@pytest.mark.parametrize("fill", ["copy", "foreach"])
def test_sharded_transformer_matches_eager(fill: str) -> None:
    _check(fill, {"codegen": "eager", "cache": False})
    removed = [
        e for e in torchloom.report().entries("resize") if e.kind == "remove_resize_copy_resize"
    ]
    assert len(removed) == 24
    assert "resize_storage_bytes_" not in dict(torchloom.report()[0].graphs)["forward"]


def test_sharded_transformer_with_dynamic_shapes_removes_chains_in_one_graph() -> None:
    # dynamic=True: one graph serves every sequence length, resize passes applied to it
    _check("copy", {"codegen": "eager", "cache": False}, dynamic=True)
    records = [r for r in torchloom.report() if not any(e.area == "pipeline" for e in r.entries)]
    assert len(records) == 1
    removed = [e for e in records[0].entries if e.area == "resize"]
    assert sum(e.kind == "remove_resize_copy_resize" for e in removed) == 24
    assert "resize_storage_bytes_" not in dict(records[0].graphs)["forward"]


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_sharded_transformer_matches_eager_on_cuda(codegen: str) -> None:
    _check("copy", {"codegen": codegen, "cache": False}, device="cuda")


# --- FSDPPatternStack: what the training step holds at its peak ------------------------------
#
# The forward hands backward the parameters themselves (zero storage), never a
# filled copy. Without compiled autograd the compiled backward is one autograd
# node: it returns every weight gradient at once, and the post-accumulate-grad
# hooks that free the weights run only after it, so all weights and all
# gradients are alive together (eager frees each weight as its gradient lands).
# Under compiled autograd the hooks are traced into the backward graph, so each
# weight dies (and, with reduce_grads, each gradient is reduced and dropped)
# before the next layer's gradient is computed.

EAGER_CODEGEN = {"codegen": "eager", "cache": False}
LAYERS, DIM = 4, 256
UNIT = DIM * DIM * 4  # one weight, or one weight gradient


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes allocated during ``fn`` above its start, from the profiler's
    allocation events (each carries the allocator's running total)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    events.sort()
    start = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - start


def _peak_bytes(fn: Callable[[], object], device: str) -> int:
    if device == "cpu":
        return _cpu_peak_bytes(fn)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _compiled_autograd(on: bool, options: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    if not on:
        return contextlib.nullcontext()
    import torch._dynamo.compiled_autograd as compiled_autograd

    backward = torch.compile(backend="loom", options=options, fullgraph=True)
    return compiled_autograd._enable(backward)


def _stack_step(
    model: FSDPPatternStack, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    out = forward(x)
    model.prepare_backward(out)
    out.sum().backward()
    return out.detach()


def _grads(model: FSDPPatternStack) -> list[torch.Tensor]:
    if model.reduce_grads:
        return [model.grad_shard(i).clone() for i in range(len(model.weights))]
    return [w.grad.clone() for w in model.weights if w.grad is not None]


def _drop_grads(model: FSDPPatternStack, x: torch.Tensor) -> None:
    # NOTE: x.grad too: a step that accumulates into an existing input gradient
    # is another autograd graph for compiled autograd, so it would recompile the
    # backward (with Inductor: tens of MiB of compile-time allocations).
    x.grad = None
    for w in model.weights:
        w.grad = None


def _compiles() -> tuple[int, int]:
    """Compiled-autograd captures and Dynamo graphs compiled so far."""
    from torch._dynamo.utils import counters

    return counters["compiled_autograd"]["captures"], counters["stats"]["unique_graphs"]


def _run_stack(
    variant: str,
    reduce_grads: bool,
    device: str = "cpu",
    options: dict[str, Any] = EAGER_CODEGEN,
    steps: int = 3,
) -> tuple[list[Any], int]:
    """Outputs, gradients and storage sizes of ``steps`` steps, and the peak
    memory of one more step above its start (gradients dropped before it). That
    step is steady state: it must compile nothing (compiled autograd's cache hit)."""
    torch._dynamo.reset()
    model = FSDPPatternStack(LAYERS, DIM, fill="copy", reduce_grads=reduce_grads, device=device)
    forward: Any = (
        model
        if variant == "eager"
        else torch.compile(model, backend="loom", options=options, fullgraph=True)
    )
    x = torch.randn(16, DIM, generator=torch.Generator().manual_seed(4))
    x = x.to(device).requires_grad_()
    seen = []
    with _compiled_autograd(variant == "loom+ca", options):
        for _ in range(steps):
            _drop_grads(model, x)
            out = _stack_step(model, forward, x)
            assert x.grad is not None
            seen.append((out, x.grad.clone(), _grads(model), model.storage_nbytes()))
        _drop_grads(model, x)
        compiled = _compiles()
        peak = _peak_bytes(lambda: _stack_step(model, forward, x), device)
        assert _compiles() == compiled, f"{variant}: the measured step compiled"
    return seen, peak


def test_forward_hands_backward_the_zero_storage_parameters() -> None:
    model = FSDPPatternStack(3, 16, fill="copy")
    compiled = torch.compile(model, backend="loom", options=EAGER_CODEGEN, fullgraph=True)
    out = compiled(torch.randn(4, 16, requires_grad=True))
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == (16, 16)]
    assert len(saved) == 3  # every layer's weight, for the gradient of its input
    assert all(t.untyped_storage().nbytes() == 0 for t in saved)
    for w in model.weights:  # each is the parameter's own storage: it grows with it
        w.untyped_storage().resize_(16 * 16 * 4)
        assert sum(t.untyped_storage().nbytes() > 0 for t in saved) == 1
        w.untyped_storage().resize_(0)


def _check_stack_peaks(reduce_grads: bool, device: str, options: dict[str, Any]) -> None:
    want, eager_peak = _run_stack("eager", reduce_grads, device, options)
    got, ca_peak = _run_stack("loom+ca", reduce_grads, device, options)
    _, loom_peak = _run_stack("loom", reduce_grads, device, options)
    for (o1, x1, g1, s1), (o2, x2, g2, s2) in zip(got, want, strict=True):
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(x1, x2)
        assert len(g1) == len(g2) == LAYERS
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b)
        assert s1 == s2 == [0] * LAYERS
    assert all(g.fallback is None for g in torchloom.report())
    # every gathered weight and every gradient at once without compiled autograd
    assert loom_peak >= 2 * LAYERS * UNIT
    # eager: the backward's gather of all weights plus one gradient at a time
    assert eager_peak < (LAYERS + 1.5) * UNIT
    # compiled autograd: as eager, plus the copy its AccumulateGrad makes of a new gradient
    assert ca_peak < (LAYERS + 2.5) * UNIT


@pytest.mark.parametrize("reduce_grads", [False, True], ids=["grads-kept", "grads-reduced"])
def test_compiled_autograd_matches_eager_and_frees_each_weight_inside_the_backward(
    reduce_grads: bool,
) -> None:
    _check_stack_peaks(reduce_grads, "cpu", EAGER_CODEGEN)


@pytest.mark.inductor
def test_compiled_autograd_with_inductor_codegen_never_reads_a_freed_weight() -> None:
    # Inductor's backward computes each weight gradient before the input gradient
    # that still reads the weight, so compiled autograd's free lands before that read
    options = {"codegen": "inductor", "cache": False}
    want, _ = _run_stack("eager", False, steps=2)
    got, _ = _run_stack("loom+ca", False, options=options, steps=2)
    for (o1, x1, g1, s1), (o2, x2, g2, s2) in zip(got, want, strict=True):
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(x1, x2)
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b)
        assert s1 == s2 == [0] * LAYERS
    late = [
        e.message
        for e in torchloom.report().entries("resize")
        if "after its resize to 0" in e.message
    ]
    assert late and all(m.startswith("inference: ") for m in late)


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["inductor", "eager"])
@pytest.mark.parametrize("reduce_grads", [False, True], ids=["grads-kept", "grads-reduced"])
def test_compiled_autograd_step_peak_on_cuda(reduce_grads: bool, codegen: str) -> None:
    _check_stack_peaks(reduce_grads, "cuda", {"codegen": codegen, "cache": False})
