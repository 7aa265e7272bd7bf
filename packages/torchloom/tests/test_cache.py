"""The cache stage end to end: hits skip AOT tracing, partition and codegen and
return what a cold compile returns; misses say why; nothing about the cache can
fail a compile."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import loom_cache
import torchloom

EAGER = {"codegen": "eager"}


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHLOOM_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("TORCHLOOM_CACHE", raising=False)
    torchloom.reset()
    yield tmp_path / "cache"
    torchloom.reset()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _step(options: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step of a fresh compile; returns the loss and the gradients."""
    torchloom.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="loom", options=options)
    loss = compiled(torch.ones(5, 8)).pow(2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _cache_entries() -> list[tuple[str, str]]:
    return [(e.kind, e.message) for e in torchloom.report().entries("cache")]


def _stage_names() -> set[str]:
    return {s.name for g in torchloom.report() for s in g.stages}


def test_second_compile_hits_skips_aot_work_and_matches_the_cold_compile() -> None:
    cold_loss, cold_grads = _step(EAGER)
    assert [k for k, _ in _cache_entries()] == ["miss", "stored"]
    assert "partition" in _stage_names()
    cold_graphs = [k for g in torchloom.report() for k, _ in g.graphs]

    warm_loss, warm_grads = _step(EAGER)
    assert [k for k, _ in _cache_entries()] == ["hit"]
    assert "partition" not in _stage_names()  # no AOT tracing, no partition, no codegen
    torch.testing.assert_close(warm_loss, cold_loss, rtol=0, atol=0)
    for a, b in zip(warm_grads, cold_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the report reads as the cold one did: the same graphs are shown
    assert [k for g in torchloom.report() for k, _ in g.graphs] == cold_graphs


def test_other_options_miss_and_the_miss_names_the_option() -> None:
    _step(EAGER)
    _step({**EAGER, "resize_remove_chains": False})
    kinds = [k for k, _ in _cache_entries()]
    assert kinds == ["miss", "stored"]
    miss = _cache_entries()[0][1]
    assert "options: resize_remove_chains: True -> False" in miss
    _step(EAGER)
    assert [k for k, _ in _cache_entries()] == ["hit"]


def test_cache_off_by_option_or_environment_stores_nothing(
    _fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _step({**EAGER, "cache": False})
    assert [k for k, _ in _cache_entries()] == ["bypass"]
    monkeypatch.setenv("TORCHLOOM_CACHE", "0")
    _step(EAGER)
    assert [k for k, _ in _cache_entries()] == ["bypass"]
    assert list(loom_cache.LocalStore(_fresh).entries()) == []


def test_corrupt_entry_is_a_miss_with_a_reason_and_the_compile_is_still_right(_fresh: Path) -> None:
    cold = _step(EAGER)
    store = loom_cache.LocalStore(_fresh)
    (info,) = list(store.entries())
    path = store.path_of(info.digest)
    path.write_bytes(path.read_bytes()[:-7])
    again = _step(EAGER)
    kind, message = _cache_entries()[0]
    assert kind == "miss" and "truncated" in message
    torch.testing.assert_close(again[0], cold[0])


def test_artifact_that_fails_to_load_is_a_miss_not_a_failure(_fresh: Path) -> None:
    _step(EAGER)
    store = loom_cache.LocalStore(_fresh)
    (info,) = list(store.entries())
    # a well-formed entry whose payload is not a loadable artifact
    store.put(loom_cache.Entry(info.key, b"not a pickle"))
    loss, _ = _step(EAGER)
    kind, message = _cache_entries()[0]
    assert kind == "miss" and "unreadable artifact" in message
    assert torch.isfinite(loss)


def test_unreachable_redis_warns_and_compiles_with_the_local_tier(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("TORCHLOOM_REMOTE_CACHE_TIMEOUT", "0.2")
    monkeypatch.setenv("TORCHLOOM_CACHE_KEY", "fleet-key-0123456789abcdef")
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    _step(EAGER)
    _step(EAGER)
    assert [k for k, _ in _cache_entries()] == ["hit"]
    assert any("remote tier unavailable" in r.getMessage() for r in caplog.records)


def test_cache_dir_naming_a_regular_file_compiles_right_with_a_miss_and_not_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("a regular file")
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(a_file))
    caplog.set_level(logging.WARNING, logger="torchloom.cache")
    torchloom.reset()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + x

    x = torch.linspace(-1, 1, 7)
    compiled = torch.compile(fn, backend="loom", options=EAGER)
    torch.testing.assert_close(compiled(x), fn(x))
    (miss, not_stored) = _cache_entries()
    assert miss[0] == "miss" and "unusable" in miss[1]
    assert not_stored[0] == "not-stored" and "unusable" in not_stored[1]
    assert a_file.read_text() == "a regular file"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "local tier is off" in warnings[0]


def test_opaque_call_bypasses_the_cache_and_the_report_says_why() -> None:
    @torch._dynamo.allow_in_graph
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f = torch.compile(lambda x: opaque(x).sin(), backend="loom", options=EAGER)
    x = torch.randn(4)
    torch.testing.assert_close(f(x), (x * 2).sin())
    (entry,) = torchloom.report().entries("cache")
    assert entry.kind == "bypass" and entry.get("kind_") == "opaque_call"
    assert "user_cache_hash" in entry.message


_PROCESS = r"""
import torch, torchloom
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
compiled = torch.compile(model, backend="loom", options={"codegen": "eager"})
loss = compiled(torch.ones(5, 8)).pow(2).sum()
loss.backward()
kinds = ",".join(e.kind for e in torchloom.report().entries("cache"))
grads = ",".join(repr(p.grad.double().sum().item()) for p in model.parameters())
print(kinds, repr(loss.item()), grads)
"""


def test_second_process_gets_a_full_hit_with_identical_outputs_and_gradients(
    _fresh: Path,
) -> None:
    env = {**os.environ, "TORCHLOOM_CACHE_DIR": str(_fresh)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PROCESS],
            env={**env, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert runs[0][0] == "miss,stored" and runs[1][0] == "hit"
    assert runs[0][1:] == runs[1][1:]


_COUNTED_PROCESS = r"""
import torch, torchloom, loom_cache, loom_hops
import torch._functorch.aot_autograd as aot
from loom_hops import _hook_graphs
from torchloom import _pipeline
calls = {"aot_trace": 0, "hook_trace": 0, "cold": 0, "fingerprint": 0}
def counted(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        calls[key] += 1
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)
counted(aot, "aot_stage1_graph_capture", "aot_trace")
counted(_hook_graphs.GraphModuleHooks, "trace_pack", "hook_trace")
counted(_pipeline, "compile_cold", "cold")
counted(loom_cache, "graph_fingerprint", "fingerprint")
class Scale(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
    def forward(self, x):
        return x * self.scale
pack, unpack = (torch.fx.symbolic_trace(Scale(s)) for s in (2.0, 0.5))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
compiled = torch.compile(model, backend="loom", options={"codegen": "eager"})
with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
    loss = compiled(torch.ones(5, 8)).pow(2).sum()
loss.backward()
kinds = ",".join(e.kind for e in torchloom.report().entries("cache"))
print(kinds, ",".join(f"{k}={v}" for k, v in sorted(calls.items())), repr(loss.item()))
"""


def test_a_hit_in_another_process_traces_nothing_and_hashes_the_graph_once(
    _fresh: Path,
) -> None:
    """A warm process is served: no AOTAutograd trace, no hook tracing, no cold
    compile, and the key fingerprints the Dynamo graph once."""
    env = {**os.environ, "TORCHLOOM_CACHE_DIR": str(_fresh)}
    cold, warm = (
        subprocess.run(
            [sys.executable, "-c", _COUNTED_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for _ in range(2)
    )
    assert cold[0] == "miss,stored" and warm[0] == "hit"
    cold_calls = dict(kv.split("=") for kv in cold[1].split(","))
    assert int(cold_calls["aot_trace"]) == 1 and int(cold_calls["hook_trace"]) > 0
    assert warm[1] == "aot_trace=0,cold=0,fingerprint=1,hook_trace=0"
    assert warm[2] == cold[2]


class _Layers(torch.nn.Module):
    # NOTE: a module of the user's own: Dynamo graph-breaks at DDP's forward and
    # compiles the wrapped module's forward as a frame of its own, which it skips
    # when that forward is torch.nn code (an nn.Sequential).
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _ddp_step(init_file: Path) -> tuple[list[str], list[torch.Tensor]]:
    """One step of a DDP-wrapped model compiled fresh (one rank, gloo): Dynamo's DDP
    optimizer splits the graph at bucket boundaries and compiles each piece with loom."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torchloom.reset()
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _Layers()
        # NOTE: 1 MiB is the smallest cap Dynamo's DDP optimizer accepts (DDP's first
        # bucket); each Linear holds just over 1 MiB, so each is a bucket of its own.
        ddp = DDP(model, bucket_cap_mb=1)
        compiled = torch.compile(ddp, backend="loom", options=EAGER)
        compiled(torch.ones(3, 512)).pow(2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    finally:
        dist.destroy_process_group()
    return [e.kind for e in torchloom.report().entries("cache")], grads


def test_ddp_optimizer_buckets_served_from_the_cache(tmp_path: Path) -> None:
    """A hit leaves the forward metadata on the tracing context as a cold compile does:
    Dynamo's DDP optimizer asserts it after every bucket it compiled through AOTAutograd."""
    cold_kinds, cold_grads = _ddp_step(tmp_path / "pg-cold")
    buckets = len(torchloom.report())
    assert buckets == 3 and "stored" in cold_kinds
    hit_kinds, hit_grads = _ddp_step(tmp_path / "pg-hit")
    assert hit_kinds == ["hit"] * buckets
    for a, b in zip(cold_grads, hit_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


_GRAD_HOOK_PROCESS = r"""
import torch, torchloom
from loom_hops import _grad_hook_inline
python_runs = [0]
run_hooks = _grad_hook_inline.run_hooks
def counting(*args):
    python_runs[0] += 1
    return run_hooks(*args)
_grad_hook_inline.run_hooks = counting
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
sink = []
@torch.compile(backend="loom", options={"codegen": "eager"}, fullgraph=True)
def step(x):
    h = torchloom.grad_hook(model[0](x), lambda g: sink.append(g.norm()), lambda g: g * 0.5)
    return model[2](model[1](h)).pow(2).sum()
for _ in range(2):
    step(torch.ones(5, 8)).backward()
kinds = ",".join(e.kind for e in torchloom.report().entries("cache"))
hooks = ",".join(e.kind for e in torchloom.report().entries("grad_hooks"))
grads = ",".join(repr(p.grad.double().sum().item()) for p in model.parameters())
print(kinds, hooks, python_runs[0], repr(float(sum(sink))), grads)
"""


# NOTE: test_a_hit_in_another_process_traces_nothing_and_hashes_the_graph_once covers a
# cross-process hit on the newest release; this one runs on the locked torch only.
@pytest.mark.fresh_processes
def test_grad_hooks_are_inlined_with_the_cache_on_cold_and_on_a_hit_in_another_process(
    _fresh: Path,
) -> None:
    """The backward of a graph with grad_hook sites compiles at its first call, when
    the hooks are known (the entry is stored right after); a hit in a fresh process
    finds the traces again from its first call's hooks: no hook runs as Python."""
    env = {**os.environ, "TORCHLOOM_CACHE_DIR": str(_fresh)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", _GRAD_HOOK_PROCESS],
            env={**env, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert runs[0][:3] == ["miss,pending,stored", "inlined", "0"]
    assert runs[1][:3] == ["hit", "inlined", "0"]
    assert runs[0][3:] == runs[1][3:]


def test_content_equal_hook_pairs_give_one_key() -> None:
    """Hook pairs are keyed by content: new GraphModules of the same graphs hit."""
    _step_with_hooks(2.0)
    (stored,) = [e for e in torchloom.report().entries("cache") if e.kind == "stored"]
    _step_with_hooks(2.0)  # new GraphModule objects, equal graphs
    (hit,) = torchloom.report().entries("cache")
    assert hit.kind == "hit" and hit.get("digest") == stored.get("digest")


def test_torchloom_cache_command_shows_stats_and_explains_the_last_miss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchloom._cli import main

    _step(EAGER)
    _step({**EAGER, "resize_remove_chains": False})
    capsys.readouterr()
    assert main(["cache", "stats"]) == 0
    out = capsys.readouterr().out
    assert "entries    2" in out and "misses     2" in out
    assert main(["cache", "explain"]) == 0
    assert "resize_remove_chains: True -> False" in capsys.readouterr().out


class _ScalePack(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _hooks(scale: float) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    return (
        torch.fx.symbolic_trace(_ScalePack(scale)),
        torch.fx.symbolic_trace(_ScalePack(1.0 / scale)),
    )


def _step_with_hooks(scale: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autograd.graph.saved_tensors_hooks(*_hooks(scale)):
        return _step(EAGER)


def test_saved_tensor_hooks_enter_the_key_and_a_hit_replays_their_placement() -> None:
    cold = _step_with_hooks(2.0)
    assert [k for k, _ in _cache_entries()] == ["miss", "stored"]
    cold_hooks = [(e.kind, e.message) for e in torchloom.report().entries("hooks")]
    assert [k for k, _ in cold_hooks] == ["variant", "placed"]
    warm = _step_with_hooks(2.0)
    assert [k for k, _ in _cache_entries()] == ["hit"]
    assert [(e.kind, e.message) for e in torchloom.report().entries("hooks")] == cold_hooks
    torch.testing.assert_close(warm[0], cold[0], rtol=0, atol=0)
    for a, b in zip(warm[1], cold[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _step_with_hooks(4.0)  # other hook content: a miss that names the hooks
    kind, message = _cache_entries()[0]
    assert kind == "miss" and "hooks" in message


def test_dynamic_shapes_hit_and_serve_every_size() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu().sum(-1) * x.shape[0]

    w = torch.randn(8, 3, requires_grad=True)
    for expected in (["miss", "stored"], ["hit"]):
        torchloom.reset()
        g = torch.compile(f, backend="loom", options=EAGER, dynamic=True)
        for n in (5, 7, 11):
            x = torch.randn(n, 8)
            torch.testing.assert_close(g(x, w), f(x, w))
        assert [k for k, _ in _cache_entries()] == expected
        assert len(torchloom.report()) == 1  # one graph serves every size


def test_key_changes_when_loom_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edited pass in an editable install (same version) must miss, never reuse
    what the old code made: the source hash of loom's packages is in the key."""
    from torchloom import _cache

    pkg = tmp_path / "src" / "loom_fake_pass"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def rewrite(g):\n    return g\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    modules = ("loom_fake_pass",)
    before = _cache._versions(modules=modules)
    (pkg / "__init__.py").write_text("def rewrite(g):\n    return g.clone()\n")
    _cache.loom_source_hash.cache_clear()  # read once per process: a new process reads again
    after = _cache._versions(modules=modules)
    assert "source=" in before
    assert before != after


def test_inductor_compile_workers_wake_on_a_hit_as_on_a_cold_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Inductor's backend wakes its compile workers on entry, hit or miss; a hit loads
    # kernels through them too, so loom must wake them before its cache lookup.
    from torchloom import _torch_compat

    woken: list[int] = []
    monkeypatch.setattr(
        _torch_compat, "warm_compile_workers", lambda inputs: woken.append(len(inputs))
    )
    cold_loss, _ = _step({"codegen": "inductor"})
    assert [k for k, _ in _cache_entries()] == ["miss", "stored"]
    assert len(woken) == 1 and woken[0] > 0
    warm_loss, _ = _step({"codegen": "inductor"})
    assert [k for k, _ in _cache_entries()] == ["hit"]
    assert len(woken) == 2
    assert "inductor.workers" in _stage_names()
    torch.testing.assert_close(warm_loss, cold_loss, rtol=0, atol=0)
    # eager codegen has no compile workers to wake
    _step(EAGER)
    assert len(woken) == 2


def test_cache_list_labels_a_module_program_by_its_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchloom._cli import main

    _step(EAGER)  # torch.nn.Sequential: no frame of user code in its graph

    def user_fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    torch.compile(user_fn, backend="loom", options=EAGER)(torch.ones(3))
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    labels = sorted(line.split()[-1] for line in capsys.readouterr().out.splitlines())
    assert labels == ["test_cache.py:user_fn", "torch.nn.modules.container:Sequential.forward"]
