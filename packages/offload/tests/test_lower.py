"""Recognising offload pairs and lowering them, on graphs of fake CUDA tensors (no GPU)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import loom_offload


def invoke(sub: torch.fx.GraphModule, *args: Any) -> Any:
    """The subgraph-call convention of placed hook graphs: ``op(subgraph, *operands)``."""
    return sub(*args)


def _trace(fn: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    return make_fx(fn)(*args)


def _pair(
    mode: FakeTensorMode, t: torch.Tensor, pack: Callable[..., Any], unpack: Callable[..., Any]
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    with mode:
        p = _trace(lambda x: (pack(x),), t)
        host = pack(t)
        u = _trace(lambda h: (unpack(h),), host)
    return p, u


def _save_on_cpu(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.size(), dtype=x.dtype, device="cpu").copy_(x)


def test_copies_to_the_host_and_back_are_recognised() -> None:
    mode = FakeTensorMode()
    with mode:
        t = torch.empty(4, 16, 8, device="cuda").transpose(1, 2)
    for pack in (_save_on_cpu, lambda x: x.cpu(), lambda x: x.to("cpu").clone()):
        p, u = _pair(mode, t, pack, lambda h: h.to("cuda"))
        assert loom_offload.why_not_offload_pack(p, t) is None
        assert loom_offload.why_not_offload_unpack(u, t) is None


def test_casts_and_quantisation_are_not_offload() -> None:
    mode = FakeTensorMode()
    with mode:
        t = torch.empty(64, 64, device="cuda")
    p, _ = _pair(mode, t, lambda x: x.to(torch.bfloat16).cpu(), lambda h: h.to("cuda").float())
    assert "dtype" in (loom_offload.why_not_offload_pack(p, t) or "")
    p, _ = _pair(mode, t, lambda x: (x * 2).cpu(), lambda h: h.cuda())
    assert "computes aten.mul" in (loom_offload.why_not_offload_pack(p, t) or "")
    p, _ = _pair(mode, t, lambda x: x.clone(), lambda h: h)
    assert "keeps it on cuda" in (loom_offload.why_not_offload_pack(p, t) or "")


def _placed_graphs(
    mode: FakeTensorMode, n: int, numel: int
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[loom_offload.OffloadSite]]:
    """A forward of ``n`` chained relus, each saved through a ``.cpu()`` pair, and a
    backward that reads them in reverse order."""
    root = torch.nn.Module()
    fg, bg = torch.fx.Graph(), torch.fx.Graph()
    with mode:
        x_val = torch.empty(numel, device="cuda")
    x = fg.placeholder("x")
    x.meta["val"] = x_val
    leaves: list[torch.fx.Node] = []
    saved_nodes = []
    prev = x
    for i in range(n):
        relu = fg.call_function(torch.ops.aten.relu.default, (prev,))
        with mode:
            relu.meta["val"] = torch.empty(numel, device="cuda")
        relu.meta["nn_module_stack"] = {"k": (f"layers.{i}", torch.nn.Module)}
        p, u = _pair(mode, relu.meta["val"], lambda t: t.cpu(), lambda h: h.to("cuda"))
        setattr(root, f"pack_{i}", p)
        setattr(root, f"unpack_{i}", u)
        get = fg.get_attr(f"pack_{i}")
        call = fg.call_function(invoke, (get, relu))
        leaf = fg.call_function(operator.getitem, (call, 0), name=f"relu_{i}_packed_0")
        with mode:
            leaf.meta["val"] = torch.empty(numel)
        leaves.append(leaf)
        saved_nodes.append((relu, call))
        prev = relu
    fg.output((prev, *leaves))
    forward = torch.fx.GraphModule(root, fg)
    bw_root = torch.nn.Module()
    hosts = []
    for i in range(n):
        h = bg.placeholder(f"relu_{i}_packed_0")
        h.meta["val"] = leaves[i].meta["val"]
        hosts.append(h)
    acc = None
    sites = []
    fw_calls = {n.name: n for n in forward.graph.nodes}
    for i in reversed(range(n)):
        setattr(bw_root, f"unpack_{i}", getattr(root, f"unpack_{i}"))
        get = bg.get_attr(f"unpack_{i}")
        call = bg.call_function(invoke, (get, hosts[i]))
        out = bg.call_function(operator.getitem, (call, 0))
        acc = out if acc is None else bg.call_function(torch.ops.aten.add.Tensor, (acc, out))
        sites.append((i, call))
    bg.output((acc,))
    backward = torch.fx.GraphModule(bw_root, bg)
    bw_calls = {i: call for i, call in sites}
    result = []
    for i, (relu, _) in enumerate(saved_nodes):
        pack_call = fw_calls[saved_nodes[i][1].name]
        result.append(
            loom_offload.OffloadSite(
                name=relu.name,
                pack_call=pack_call,
                unpack_call=bw_calls[i],
                saved=relu.meta["val"],
                activation=True,
                layer=loom_offload.layer_of(relu),
            )
        )
    return forward, backward, result


def test_lowering_offloads_keeps_the_tail_and_schedules_prefetches() -> None:
    mode = FakeTensorMode()
    numel = 1 << 18  # 1 MiB of float32 each
    forward, backward, sites = _placed_graphs(mode, 6, numel)
    options = loom_offload.OffloadOptions(
        min_bytes=0, window_bytes=1 << 20, prefetch_bytes=2 << 20, prefetch_layers=2
    )
    plan = loom_offload.lower_offload(forward, backward, sites, options)
    actions = [d.action for d in plan.decisions]
    assert actions == ["offloaded"] * 5 + ["kept"], plan.summary()
    # backward order is relu_4, relu_3, ...: each reload starts the next ones within 2 layers
    prefetch = {d.name: d.prefetch for d in plan.decisions}
    assert prefetch[sites[4].name] == (sites[3].name, sites[2].name)
    assert prefetch[sites[3].name] == (sites[1].name,)
    assert prefetch[sites[0].name] == ()
    fw_targets = [n.target for n in forward.pack_0.graph.nodes if n.op == "call_function"]
    assert fw_targets == [loom_offload.offload_op]
    bw_targets = [n.target for n in backward.unpack_4.graph.nodes if n.op == "call_function"]
    assert bw_targets == [loom_offload.reload_op]
    assert len(sites[4].unpack_call.args) == 4  # the subgraph, its host tensor, two prefetches
    kept = [n.target for n in forward.pack_5.graph.nodes if n.op == "call_function"]
    assert kept == []
    assert "1 kept on the device" in plan.summary()


def test_small_tensors_and_inputs_stay_on_the_device() -> None:
    mode = FakeTensorMode()
    forward, backward, sites = _placed_graphs(mode, 3, 1024)
    sites[0] = loom_offload.OffloadSite(
        **{
            **{
                f: getattr(sites[0], f)
                for f in ("name", "pack_call", "unpack_call", "saved", "layer")
            },
            "activation": False,
        }
    )
    plan = loom_offload.lower_offload(
        forward, backward, sites, loom_offload.OffloadOptions(window_bytes=0)
    )
    reasons = [d.reason for d in plan.decisions]
    assert reasons[0].startswith("a graph input or user output")
    assert reasons[1:] == ["smaller than min_bytes"] * 2
