"""The hooks stage end to end: ``saved_tensors_hooks`` placed inside graphs compiled
with ``backend="loom"`` match the same hooks in eager (outputs, gradients, the
hooks' side effects), refusals stay eager with the reason in the report (or
raise in strict mode), and ``register_hook`` on intermediates matches eager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx

import torchloom

OPTS: dict[str, Any] = {"codegen": "eager", "cache": False}
FP8_MAX = 448.0


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torchloom.reset()
    yield
    torchloom.reset()


# -- hooks ----------------------------------------------------------------------------


def bf16_pack(t: torch.Tensor) -> Any:
    return (t.dtype, t.to(torch.bfloat16))


def cast_unpack(p: Any) -> torch.Tensor:
    return p[1].to(p[0])


def fp8_pack(t: torch.Tensor) -> Any:
    scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (t.dtype, (t / scale).to(torch.float8_e4m3fn), scale)


def fp8_unpack(p: Any) -> torch.Tensor:
    dtype, q, scale = p
    return (q.to(torch.float32) * scale).to(dtype)


def offload_pack(t: torch.Tensor) -> Any:
    return (t.device, t.to("cpu"))


def offload_unpack(p: Any) -> torch.Tensor:
    return p[1].to(p[0])


class _Bf16Pack(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return (x.dtype, x.to(torch.bfloat16))


class _CastUnpack(torch.nn.Module):
    def forward(self, p: Any) -> torch.Tensor:
        return p[1].to(p[0])


def gm_bf16() -> tuple[Any, Any]:
    return torch.fx.symbolic_trace(_Bf16Pack()), torch.fx.symbolic_trace(_CastUnpack())


class Recorder:
    """A counter and the list of packed shapes, as a Python hook pair."""

    def __init__(self) -> None:
        self.count = {"pack": 0, "unpack": 0}
        self.shapes: list[tuple[int, ...]] = []

    def hooks(self) -> tuple[Any, Any]:
        count, shapes = self.count, self.shapes

        def pack(t: torch.Tensor) -> Any:
            count["pack"] += 1
            shapes.append(tuple(t.shape))
            return (t.dtype, t.to(torch.bfloat16))

        def unpack(p: Any) -> torch.Tensor:
            count["unpack"] += 1
            return p[1].to(p[0])

        return pack, unpack


# -- helpers --------------------------------------------------------------------------


def _mlp(device: str = "cpu", width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
    ).to(device)


def _train_step(fn: Any, model: torch.nn.Module, x: torch.Tensor, hooks: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    if hooks is None:
        out = fn(x)
    else:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            out = fn(x)
    out.square().sum().backward()
    assert x.grad is not None
    return [out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], **tol: Any) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)


def _entries(kind: str) -> list[torchloom.ReportEntry]:
    return [e for e in torchloom.report().entries("hooks") if e.kind == kind]


def check_against_eager(
    hooks: Any,
    device: str = "cpu",
    options: Any = None,
    backend: Any = "loom",
    model: torch.nn.Module | None = None,
    x: torch.Tensor | None = None,
    **tol: Any,
) -> Any:
    model = _mlp(device) if model is None else model
    x = torch.randn(8, 16, device=device) if x is None else x
    want = _train_step(model, model, x, hooks)
    compiled = torch.compile(model, backend=backend, options=options or OPTS)
    got = _train_step(compiled, model, x, hooks)
    _assert_same(got, want, **tol)
    return compiled, model, x


# -- saved-tensor hooks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "hooks",
    [(bf16_pack, cast_unpack), (fp8_pack, fp8_unpack), (offload_pack, offload_unpack)],
    ids=["bf16", "fp8", "offload"],
)
def test_python_hooks_are_placed_in_the_graph_and_match_eager(hooks: Any) -> None:
    check_against_eager(hooks)
    (placed,) = _entries("placed")
    assert placed.get("packed") and "traced Python hooks" in placed.message


def _as_if_offloaded() -> tuple[torchloom.Pipeline, list[tuple[str, bool]]]:
    """A pipeline whose placements claim their packed values live on another device,
    and whose codegen calls record whether Inductor's peak-memory reordering was on
    (no second device on a CPU machine)."""
    import dataclasses

    import loom_hops
    from torchloom import _torch_compat as compat
    from torchloom._pipeline import eager_codegen

    seen: list[tuple[str, bool]] = []

    def place_offloaded(*args: Any, **kwargs: Any) -> Any:
        placement = loom_hops.place_saved_tensor_hooks(*args, **kwargs)
        packed = tuple(
            dataclasses.replace(p, crossing_devices=("cuda:0",)) for p in placement.packed
        )
        return dataclasses.replace(placement, packed=packed)

    def recording_codegen(gm: Any, inputs: Any, static: Any) -> Any:
        kind = "backward" if any(n.name == "tangents_1" for n in gm.graph.nodes) else "forward"
        seen.append((kind, bool(compat.inductor_config.reorder_for_peak_memory)))
        return eager_codegen(gm, inputs, static)

    pipeline = torchloom.Pipeline(
        place_saved_tensor_hooks=place_offloaded, eager_codegen=recording_codegen
    )
    return pipeline, seen


def test_offloaded_graphs_are_generated_in_the_placement_order() -> None:
    pipeline, seen = _as_if_offloaded()
    check_against_eager((offload_pack, offload_unpack), backend=pipeline)
    assert sorted(seen) == [("backward", False), ("forward", False)]
    (order,) = _entries("graph_order")
    assert order.get("moved") and "reorder_for_peak_memory off" in order.message


def test_graphs_whose_packed_values_stay_put_keep_inductor_reordering() -> None:
    from torchloom import _torch_compat as compat
    from torchloom._pipeline import eager_codegen

    seen = []

    def recording_codegen(gm: Any, inputs: Any, static: Any) -> Any:
        seen.append(bool(compat.inductor_config.reorder_for_peak_memory))
        return eager_codegen(gm, inputs, static)

    pipeline = torchloom.Pipeline(eager_codegen=recording_codegen)
    check_against_eager((offload_pack, offload_unpack), backend=pipeline)  # on CPU: stays put
    assert seen == [True, True] and not _entries("graph_order")


def test_graph_module_hooks_are_taken_as_they_are() -> None:
    check_against_eager(gm_bf16())
    (placed,) = _entries("placed")
    assert "GraphModule hooks" in placed.message


def test_hook_boundaries_are_visible_in_the_report_and_gone_at_codegen() -> None:
    check_against_eager((bf16_pack, cast_unpack))
    graphs = dict(torchloom.report()[0].graphs)
    assert "loom_saved_tensor_pack" in graphs["forward+hooks"]
    assert "loom_saved_tensor_unpack" in graphs["backward+hooks"]
    assert "loom_saved_tensor" not in graphs["forward"] + graphs["backward"]


def test_counter_and_packed_shapes_replay_once_per_saved_tensor() -> None:
    eager, compiled_rec = Recorder(), Recorder()
    model, x = _mlp(), torch.randn(8, 16)
    want = _train_step(model, model, x, eager.hooks())
    compiled = torch.compile(model, backend="loom", options=OPTS)
    got = _train_step(compiled, model, x, compiled_rec.hooks())
    _assert_same(got, want)
    (placed,) = _entries("placed")
    n = len(placed.get("packed"))
    assert compiled_rec.count == {"pack": n, "unpack": n}
    assert set(compiled_rec.shapes) <= set(eager.shapes)
    assert compiled_rec.shapes == eager.shapes  # same saved set here, so eager's order
    _train_step(compiled, model, x, compiled_rec.hooks())
    assert compiled_rec.count == {"pack": 2 * n, "unpack": 2 * n}


def test_eager_hooks_are_not_applied_again() -> None:
    rec = Recorder()
    hooks = rec.hooks()
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    _train_step(compiled, model, x, hooks)
    first = rec.count["pack"]
    _train_step(compiled, model, x, hooks)
    assert rec.count["pack"] == 2 * first  # replays only: the runtime packed nothing more


def test_hooks_that_change_between_calls_recompile_and_match_eager() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    for hooks in ((bf16_pack, cast_unpack), (fp8_pack, fp8_unpack), None, gm_bf16()):
        want = _train_step(model, model, x, hooks)
        got = _train_step(compiled, model, x, hooks)
        _assert_same(got, want)
    assert len(torchloom.report()) == 4


def test_without_hooks_a_call_does_no_hook_matching_and_hooks_later_recompile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The frame compiled without hooks guards on "none active" with one C call: no
    Python pair matching runs per call, and a call under hooks still recompiles."""
    from loom_hops import _hook_match

    matched = {"n": 0}
    pair_mismatch = _hook_match.pair_mismatch

    def counting(*args: Any) -> Any:
        matched["n"] += 1
        return pair_mismatch(*args)

    # NOTE: the guards import the matcher when they are installed, so this reaches them.
    monkeypatch.setattr(_hook_match, "pair_mismatch", counting)
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    for _ in range(5):
        _train_step(compiled, model, x, None)
    assert matched["n"] == 0 and len(torchloom.report()) == 1
    want = _train_step(model, model, x, (bf16_pack, cast_unpack))
    _assert_same(_train_step(compiled, model, x, (bf16_pack, cast_unpack)), want)
    assert len(torchloom.report()) == 2
    assert [e.kind for e in torchloom.report()[1].entries if e.area == "hooks"][-1] == "placed"


def test_no_grad_calls_pack_nothing() -> None:
    rec = Recorder()
    compiled = torch.compile(_mlp(), backend="loom", options=OPTS)
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(*rec.hooks()):
        compiled(torch.randn(4, 16))
    assert rec.count == {"pack": 0, "unpack": 0}
    assert not _entries("placed")


def test_gradient_accumulation_over_several_forwards() -> None:
    model, xs = _mlp(), [torch.randn(4, 16) for _ in range(3)]
    compiled = torch.compile(model, backend="loom", options=OPTS)

    def accumulate(fn: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(fp8_pack, fp8_unpack):
            outs = [fn(x) for x in xs]  # three sets of packed tensors alive at once
        sum(o.square().sum() for o in outs).backward()  # type: ignore[union-attr]
        return [p.grad.clone() for p in model.parameters()]

    _assert_same(accumulate(compiled), accumulate(model))


def test_per_tensor_decisions_are_made_once_per_saved_tensor() -> None:
    limit = 100

    def pack(t: torch.Tensor) -> Any:
        if t.dtype == torch.float32 and t.numel() > limit:
            return (t.dtype, t.to(torch.bfloat16))
        return (t.dtype, t)

    check_against_eager((pack, cast_unpack))
    graphs = dict(torchloom.report()[0].graphs)
    assert "bf16" in graphs["forward+hooks"] and "f32[16]" in graphs["forward+hooks"]


def test_activation_scope_keeps_parameters_unpacked() -> None:
    # eager also rounds the saved parameters to bf16: the results differ by that much
    options = {**OPTS, "saved_tensor_hooks_scope": "activations"}
    check_against_eager((bf16_pack, cast_unpack), options=options, atol=2e-2, rtol=2e-2)
    (placed,) = _entries("placed")
    kept = dict(placed.get("kept"))
    assert kept and all("activations" in why for why in kept.values())


def test_hooks_can_stay_eager_by_option() -> None:
    options = {**OPTS, "saved_tensor_hooks_in_graph": False}
    check_against_eager((bf16_pack, cast_unpack), options=options)
    assert _entries("eager") and not _entries("placed")


def _refused_hooks() -> tuple[Any, Any]:
    def pack(t: torch.Tensor) -> Any:
        print("packing", tuple(t.shape))  # the tracer refuses print()
        return t

    return pack, lambda t: t


def test_a_refused_hook_runs_eagerly_with_the_reason_in_the_report(capsys: Any) -> None:
    check_against_eager(_refused_hooks())
    (refused,) = _entries("refused")
    assert refused.get("kind_") == "hook_not_traceable" and "print" in refused.message
    assert "packing" in capsys.readouterr().out  # it ran, eagerly


def test_a_refused_hook_raises_in_strict_mode() -> None:
    compiled = torch.compile(_mlp(), backend="loom", options={**OPTS, "strict": True})
    with (
        torch.autograd.graph.saved_tensors_hooks(*_refused_hooks()),
        pytest.raises(Exception, match="hook_not_traceable"),
    ):
        compiled(torch.randn(4, 16, requires_grad=True))


class _Fp8Pack(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> Any:
        return fp8_pack(t)


class _Fp8Unpack(torch.nn.Module):
    def forward(self, p: Any) -> torch.Tensor:
        return fp8_unpack(p)


def test_dynamic_shapes_one_compilation_serves_every_size() -> None:
    model = _mlp()
    hooks = (torch.fx.symbolic_trace(_Fp8Pack()), torch.fx.symbolic_trace(_Fp8Unpack()))
    compiled = torch.compile(model, backend="loom", options=OPTS, dynamic=True)
    for batch in (3, 5, 7):
        x = torch.randn(batch, 16)
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    assert len(torchloom.report()) == 1 and len(_entries("placed")) == 1
    graphs = dict(torchloom.report()[0].graphs)
    assert "Sym(" in graphs["forward+hooks"] and "f8e4m3fn" in graphs["forward+hooks"]


def test_python_hooks_under_dynamic_shapes_are_placed_once_for_every_size() -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="loom", options=OPTS, dynamic=True)
    for batch in (3, 5, 7):
        x = torch.randn(batch, 16)
        _assert_same(
            _train_step(compiled, model, x, (fp8_pack, fp8_unpack)),
            _train_step(model, model, x, (fp8_pack, fp8_unpack)),
        )
    assert len(torchloom.report()) == 1 and len(_entries("placed")) == 1


def test_a_symbolic_size_in_a_side_effect_stays_eager_with_the_reason() -> None:
    rec = Recorder()  # appends t.shape: symbolic under dynamic shapes
    hooks = rec.hooks()
    model = _mlp()
    compiled = torch.compile(model, backend="loom", options=OPTS, dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 16)
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    (refused,) = _entries("refused")
    assert "symbolic size" in refused.message
    assert (5, 16) in rec.shapes  # the hook ran eagerly, with real sizes


# -- activation checkpointing --------------------------------------------------------


class _Checkpointed(torch.nn.Module):
    """Non-reentrant ``torch.utils.checkpoint`` around attention (SDPA), an MLP or a
    whole pre-norm decoder layer (both), applied to two layers in a row."""

    def __init__(self, region: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.region = region
        self.norm1, self.norm2 = torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).view(2, 8, 3, 2, 16).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return h + self.out(a.transpose(1, 2).reshape(2, 8, 32))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.silu(self.up(self.norm2(h))))

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(h))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        region = getattr(self, self.region)
        checkpoint = torch.utils.checkpoint.checkpoint
        for _ in range(2):
            h = checkpoint(region, h, use_reentrant=False)
            if self.region != "layer":
                h = self.mlp(h) if self.region == "attention" else self.attention(h)
        return h


class _PackCounter:
    """bf16 hooks that record the shape of every tensor they pack."""

    def __init__(self) -> None:
        self.packed: list[tuple[int, ...]] = []

    def hooks(self) -> tuple[Any, Any]:
        packed = self.packed

        def pack(t: torch.Tensor) -> Any:
            packed.append(tuple(t.shape))
            return (t.dtype, t.to(torch.bfloat16))

        return pack, cast_unpack


@pytest.mark.parametrize("region", ["attention", "mlp", "layer"])
def test_hooks_are_placed_under_checkpointing_and_match_eager(region: str) -> None:
    # NOTE: CPU SDPA is tagged nondeterministic_seeded: under checkpointing the
    # partitioner saves its RNG state and the backward takes it under another name.
    model, x = _Checkpointed(region), torch.randn(2, 8, 32)
    counters = _PackCounter(), _PackCounter()
    want = _train_step(model, model, x, counters[0].hooks())
    compiled = torch.compile(model, backend="loom", options=OPTS)
    got = _train_step(compiled, model, x, counters[1].hooks())
    (placed,) = _entries("placed")
    assert not _entries("refused")
    kept = dict(placed.get("kept"))
    assert "parameter read only inside checkpointed regions" in kept.values()
    # NOTE: eager packs each region's input (and its own (0,)-shaped marker); loom
    # packs each region's input too, where the partitioner saves it.
    region_inputs = [s for s in counters[0].packed if s == (2, 8, 32)]
    assert region_inputs and set(counters[1].packed) >= {(2, 8, 32)}
    _assert_same(got, want, atol=2e-2, rtol=2e-2)


def test_the_issue_checkpointed_sdpa_packs_its_input_and_gives_eager_gradients() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q = torch.nn.Linear(32, 32)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            def attn(t: torch.Tensor) -> torch.Tensor:
                q = self.q(t).view(2, 8, 2, 16).transpose(1, 2)
                return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

            return torch.utils.checkpoint.checkpoint(attn, h, use_reentrant=False)  # type: ignore[no-any-return]

    model, x = M(), torch.randn(2, 8, 32)
    check_against_eager((bf16_pack, cast_unpack), model=model, x=x)
    (placed,) = _entries("placed")
    assert placed.get("packed") == ("primals_1",)  # what eager packs: the region's argument
    # kept unpacked, as eager keeps them: the region's parameters, and on torch 2.11 the
    # RNG state the partitioner saves for CPU SDPA's recomputation (newer releases save none)
    kept = set(dict(placed.get("kept")).values())
    assert kept <= {
        "RNG state of an op recomputed in backward",
        "parameter read only inside checkpointed regions",
    }


# -- hook pairs guarded by content ----------------------------------------------------


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _variant_messages() -> list[str]:
    return [
        e.message for e in torchloom.report().entries("hooks") if e.kind in ("variant", "eager")
    ]


def test_save_on_cpu_entered_for_every_step_compiles_once_and_matches_eager() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    before = _frames_compiled()
    for _ in range(10):
        hooks = torch.autograd.graph.save_on_cpu(device_type="cpu")
        got = _train_step(compiled, model, x, (hooks.pack_hook, hooks.unpack_hook))
    assert _frames_compiled() - before == 1 and len(torchloom.report()) == 1
    hooks = torch.autograd.graph.save_on_cpu(device_type="cpu")
    _assert_same(got, _train_step(model, model, x, (hooks.pack_hook, hooks.unpack_hook)))
    assert _entries("placed")


def stream_offload_hooks(threshold: int = 64) -> tuple[Any, Any]:
    """A user's async offload pair (issue 45: torchtune's pattern) on ``torch.cpu``'s
    streams: a side stream per pair, ``wait_stream``, ``with stream(side)``, and a
    non-blocking copy each way. The tracer drops the stream operations."""
    side = torch.cpu.Stream()

    def pack(t: torch.Tensor) -> Any:
        if t.numel() < threshold:
            return (t.device, t)
        cpu = torch.empty(t.size(), dtype=t.dtype, pin_memory=False)
        side.wait_stream(torch.cpu.current_stream())
        with torch.cpu.stream(side):
            cpu.copy_(t, non_blocking=True)
        return (t.device, cpu)

    def unpack(packed: Any) -> torch.Tensor:
        device, cpu = packed
        torch.cpu.current_stream().wait_stream(side)
        return cpu.to(device, non_blocking=True)

    return pack, unpack


def test_stream_offload_hooks_made_every_step_are_placed_once_and_match_eager() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    before = _frames_compiled()
    for _ in range(3):  # a new pair, with a new side stream, each step
        hooks = stream_offload_hooks()
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    assert _frames_compiled() - before == 1 and len(torchloom.report()) == 1
    (placed,) = _entries("placed")
    assert placed.get("packed") and "traced Python hooks" in placed.message
    assert not _entries("eager")


def test_alternating_pairs_keep_one_graph_each_and_the_report_says_why() -> None:
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    pairs = [(bf16_pack, cast_unpack), (fp8_pack, fp8_unpack)]
    for step in range(6):
        hooks = pairs[step % 2]
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    assert len(torchloom.report()) == 2
    first, second = _variant_messages()
    assert "pair #1 of this frame (the first)" in first
    assert "new saved-tensor hook pair #2" in second and "code differs" in second
    assert "bf16_pack at" in second and "fp8_pack at" in second


def test_a_closure_value_the_trace_read_recompiles_once_and_its_return_reuses() -> None:
    limit = {"numel": 10_000}

    def pack(t: torch.Tensor) -> Any:
        if t.numel() > limit["numel"]:
            return (t.dtype, t.to(torch.bfloat16))
        return (t.dtype, t)

    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    for numel in (10_000, 10_000, 100, 100, 10_000):
        limit["numel"] = numel
        got = _train_step(compiled, model, x, (pack, cast_unpack))
        _assert_same(got, _train_step(model, model, x, (pack, cast_unpack)))
    assert len(torchloom.report()) == 2
    second = _variant_messages()[1]
    assert "traced_value differs" in second and "numel" in second


#: The issue's per-step scale: a module global the unpack hook reads.
STEP_SCALE = 1.0


def _unpack_scaled(t: torch.Tensor) -> torch.Tensor:
    return t * STEP_SCALE


def test_a_per_step_global_scale_compiles_once_and_each_step_uses_its_value() -> None:
    global STEP_SCALE
    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    before = _frames_compiled()
    for step in range(12):
        STEP_SCALE = 1.0 + 0.5 * step
        hooks = (lambda t: t, _unpack_scaled)
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    assert _frames_compiled() - before == 1 and len(torchloom.report()) == 1
    (placed,) = _entries("placed")
    assert placed.get("packed") and not _entries("eager")


def test_closure_floats_and_tensor_scales_made_per_step_compile_once() -> None:
    # NOTE: delayed scaling: a float and a tensor scale in the closure of hooks made
    # anew each step; both become graph inputs, read from the step's own closure.
    def make(scale: float, amax: torch.Tensor) -> tuple[Any, Any]:
        def pack(t: torch.Tensor) -> Any:
            return (t.dtype, (t * (scale / amax)).to(torch.bfloat16))

        def unpack(p: Any) -> torch.Tensor:
            return p[1].to(p[0]) * (amax / scale)

        return pack, unpack

    model, x = _mlp(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="loom", options=OPTS)
    before = _frames_compiled()
    for step in range(5):
        hooks = make(2.0**step, torch.tensor(float(step + 1)))
        _assert_same(_train_step(compiled, model, x, hooks), _train_step(model, model, x, hooks))
    assert _frames_compiled() - before == 1
    assert len(_entries("placed")) == 1


def _mul_pack(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _mul_unpack(t: torch.Tensor) -> torch.Tensor:
    return t / 2


@pytest.mark.parametrize("backend", ["aot_eager", "loom"])
def test_saved_tensors_hooks_recompile_ported_from_pytorch(backend: str) -> None:
    """PyTorch's ``test_saved_tensors_hooks_recompile``: the active pair changes between
    calls (two pairs, then none, then again). ``aot_eager`` runs the hooks on the
    compiled function's saved tensors at run time: 1 compile. ``loom`` compiles each
    pair into the graph (packs fused where they save memory): one compile per pair
    distinct by content (here 3, "no hooks" included), and none after that; the
    trade-off is measured and explained in docs/hops.md (Switching pairs)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos().sum()

    kwargs: dict[str, Any] = {"options": OPTS} if backend == "loom" else {}
    compiled = torch.compile(fn, backend=backend, **kwargs)
    pairs = [(bf16_pack, cast_unpack), (_mul_pack, _mul_unpack), None] * 2
    before, seen = _frames_compiled(), []
    for pair in pairs:
        x = torch.randn(8, requires_grad=True)
        want_x = x.detach().clone().requires_grad_(True)
        with (
            contextlib.nullcontext()
            if pair is None
            else torch.autograd.graph.saved_tensors_hooks(*pair)
        ):
            compiled(x).backward()
            fn(want_x).backward()
        torch.testing.assert_close(x.grad, want_x.grad, atol=1e-2, rtol=1e-2)  # bf16
        seen.append(_frames_compiled() - before)
    assert seen == ([1] * 6 if backend == "aot_eager" else [1, 2, 3, 3, 3, 3])


def test_pairs_past_the_variant_limit_share_one_eager_compilation() -> None:
    def make(k: int) -> tuple[Any, Any]:
        def pack(t: torch.Tensor) -> Any:
            if k > 1:  # read by the trace: each k is another pair
                return (t.dtype, t.to(torch.bfloat16))
            return (t.dtype, t * 1)

        return pack, cast_unpack

    model, x = _mlp(), torch.randn(8, 16)
    options = {**OPTS, "saved_tensor_hooks_variants": 2}
    compiled = torch.compile(model, backend="loom", options=options)
    for k in (1, 2, 3, 4, 1, 3):
        got = _train_step(compiled, model, x, make(k))
        _assert_same(got, _train_step(model, model, x, make(k)))
    assert len(torchloom.report()) == 3  # two pairs in the graph, one eager for the rest
    eager = [e for e in torchloom.report().entries("hooks") if e.kind == "eager"]
    assert len(eager) == 1 and "past the limit of 2" in eager[0].message
    assert len(_entries("placed")) == 2


# -- register_hook on intermediates ---------------------------------------------------


def _hook_fn_pure(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    y.register_hook(lambda g: g * 2)
    return y.cos().sum()


def _hook_fn_two(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    y.register_hook(lambda g: g * 2)
    y.register_hook(lambda g: g + 1)  # eager: (g * 2) + 1
    return (y.cos() + y * 3).sum()


SCALE = torch.tensor(0.5)


def _hook_fn_closure(x: torch.Tensor) -> torch.Tensor:
    # NOTE: a closure over a tensor computed *inside* the region makes Dynamo 2.11
    # emit an invalid graph for every backend (docs/hops.md); a global one is fine.
    scale = SCALE
    y = x * 2
    y.register_hook(lambda g: g * scale)
    z = y.exp()
    z.register_hook(lambda g: g.clamp(max=1.0))
    return z.sum()


@pytest.mark.parametrize("fn", [_hook_fn_pure, _hook_fn_two, _hook_fn_closure])
def test_pure_tensor_hooks_run_in_the_compiled_backward_and_match_eager(fn: Any) -> None:
    x = torch.randn(6, requires_grad=True)
    fn(x).backward()
    want = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    torch.compile(fn, backend="loom", options=OPTS, fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, want)
    assert len(torchloom.report()) == 1


def test_a_tensor_hook_with_a_side_effect_breaks_the_graph_and_runs_once() -> None:
    seen: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.register_hook(lambda g: seen.append(g.clone()))
        return y.cos().sum()

    x = torch.randn(6, requires_grad=True)
    fn(x).backward()
    want_grad, want_seen = x.grad.clone(), seen.pop()  # type: ignore[union-attr]
    x.grad = None
    torch.compile(fn, backend="loom", options=OPTS)(x).backward()
    (got_seen,) = seen
    torch.testing.assert_close(got_seen, want_seen)
    torch.testing.assert_close(x.grad, want_grad)
    assert len(torchloom.report()) == 2  # the graph break documented in docs/hops.md
