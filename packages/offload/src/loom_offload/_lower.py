"""The lowering: placed offload pairs become transfers, scheduled for overlap.

Input: a forward and a backward where each saved tensor's pack and unpack graphs
already sit at its last forward use and its first backward use, as calls of the
form ``op(get_attr(subgraph), *operands)`` whose results are read through
``getitem`` (``loom_hops``' placement). For each site whose pair offloads
(:mod:`loom_offload._recognize`) the lowering decides:

- *kept on the device* (both graphs become the identity): a graph input or a user
  output (offloading frees nothing: something else holds it), a tensor below
  ``min_bytes``, or one of the forward's last ``window_bytes`` of offloads (still in
  flight when the forward ends, and the first the backward needs);
- *offloaded*: the pack becomes ``offload(t, window_bytes)``; the unpack becomes
  ``reload(host, device, prefetch)``, where ``prefetch`` lists the host tensors
  whose reloads start at this one: the next sites in backward order, within
  ``prefetch_bytes`` and ``prefetch_layers`` layers ahead.

Offload is lossless, so keeping a tensor changes no value: only where it lives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from loom_offload._ops import offload_op, reload_op
from loom_offload._pool import dense_span
from loom_offload._recognize import why_not_offload_pack, why_not_offload_unpack
from loom_offload._torch_compat import OpOverload, fake_mode_of

__all__ = ["OffloadOptions", "OffloadPlan", "OffloadSite", "SiteDecision", "lower_offload"]

log = logging.getLogger("torchloom.offload")

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadOptions:
    """How much to offload and how far ahead to reload (bytes are per device)."""

    #: Saved tensors smaller than this stay on the device: many small copies cost more than
    #: they save (on an H200, 8 MiB ran a Llama step 19% faster than 1 MiB at the same peak).
    min_bytes: int = 8 * MiB
    #: Forward: offload copies in flight before the compute stream waits for the oldest;
    #: also the forward's last offloads, kept on the device.
    window_bytes: int = 256 * MiB
    #: Backward: reloads started ahead of their first use, at most this many bytes ...
    prefetch_bytes: int = 512 * MiB
    #: ... and at most this many layers (``nn.ModuleList`` items) ahead.
    prefetch_layers: int = 2

    def check(self) -> None:
        for name in ("min_bytes", "window_bytes", "prefetch_bytes", "prefetch_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"OffloadOptions.{name} must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadSite:
    """One placed pair: the pack call in the forward, the unpack call in the backward
    (``None`` when the backward never reads the tensor), the saved tensor's fake value,
    whether it is an activation (not a graph input or user output), and the layer that
    made it (``""`` when unknown)."""

    name: str
    pack_call: torch.fx.Node
    unpack_call: torch.fx.Node | None
    saved: torch.Tensor
    activation: bool
    layer: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class SiteDecision:
    """What the lowering did with one site: ``offloaded``, ``kept`` or ``not_offload``."""

    name: str
    action: str
    nbytes: int
    reason: str = ""
    prefetch: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadPlan:
    """The lowering's decisions, in forward order, and the bytes moved each way per call."""

    decisions: tuple[SiteDecision, ...]
    options: OffloadOptions
    #: Distinct layers (``nn.ModuleList`` items) among the offloaded tensors.
    layers: int = 0

    @property
    def offloaded(self) -> tuple[SiteDecision, ...]:
        return tuple(d for d in self.decisions if d.action == "offloaded")

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.nbytes for d in self.offloaded)

    def summary(self) -> str:
        """One line: what was offloaded, kept and left alone, with the reasons counted."""
        kept = [d for d in self.decisions if d.action == "kept"]
        other = [d for d in self.decisions if d.action == "not_offload"]
        text = (
            f"{len(self.offloaded)} offloaded ({self.offloaded_bytes / MiB:.1f} MiB, "
            f"{self.layers} layers), "
            f"{len(kept)} kept on the device ({_reasons(kept)}), "
            f"{len(other)} not offload pairs ({_reasons(other)})"
        )
        return text.replace(" ()", "")


def _reasons(decisions: Sequence[SiteDecision]) -> str:
    counts: dict[str, int] = {}
    for d in decisions:
        counts[d.reason] = counts.get(d.reason, 0) + 1
    return "; ".join(f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda i: -i[1]))


def lower_offload(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    sites: Sequence[OffloadSite],
    options: OffloadOptions = OffloadOptions(),
) -> OffloadPlan:
    """Rewrite the sites' pack and unpack subgraphs in place; what was decided for each."""
    options.check()
    fw_order = {n: i for i, n in enumerate(forward.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(backward.graph.nodes)}
    decisions: dict[str, SiteDecision] = {}
    candidates: list[OffloadSite] = []
    for site in sites:
        why = _why_not(forward, backward, site)
        if why is not None:
            decisions[site.name] = SiteDecision(site.name, "not_offload", _nbytes(site), why)
            continue
        keep = _keep_reason(site, options)
        if keep is not None:
            decisions[site.name] = SiteDecision(site.name, "kept", _nbytes(site), keep)
        else:
            candidates.append(site)
    candidates.sort(key=lambda s: fw_order[s.pack_call])
    tail = 0
    while candidates and tail + _nbytes(candidates[-1]) <= options.window_bytes:
        site = candidates.pop()
        tail += _nbytes(site)
        decisions[site.name] = SiteDecision(
            site.name, "kept", _nbytes(site), "among the forward's last offloads (window_bytes)"
        )
    for site in sites:
        if decisions.get(site.name, SiteDecision("", "", 0)).action == "kept":
            _keep(forward, backward, site)
    reloaded = sorted(
        (s for s in candidates if s.unpack_call is not None), key=lambda s: bw_order[s.unpack_call]
    )
    schedule = _prefetch_schedule(reloaded, options)
    for site in candidates:
        ahead = schedule.get(site.name, ())
        _offload(forward, backward, site, ahead, options)
        decisions[site.name] = SiteDecision(
            site.name, "offloaded", _nbytes(site), prefetch=tuple(s.name for s in ahead)
        )
    for gm in (forward, backward):
        gm.graph.lint()  # type: ignore[no-untyped-call]
        gm.recompile()
    ordered = tuple(decisions[s.name] for s in sorted(sites, key=lambda s: fw_order[s.pack_call]))
    plan = OffloadPlan(ordered, options, len({s.layer for s in candidates if s.layer}))
    log.debug("lower_offload: %s", plan.summary())
    return plan


def _nbytes(site: OffloadSite) -> int:
    return int(site.saved.numel()) * site.saved.element_size()


def _why_not(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, site: OffloadSite
) -> str | None:
    pack = _subgraph(forward, site.pack_call)
    if pack is None:
        return "the pack is not a subgraph call"
    why = why_not_offload_pack(pack, site.saved)
    if why is not None:
        return why
    if site.unpack_call is None:
        return None
    unpack = _subgraph(backward, site.unpack_call)
    if unpack is None:
        return "the unpack is not a subgraph call"
    if len(site.unpack_call.args) != 2:
        return "the unpack takes values besides the packed tensor"
    return why_not_offload_unpack(unpack, site.saved)


def _keep_reason(site: OffloadSite, options: OffloadOptions) -> str | None:
    if site.unpack_call is None:
        return "the backward never reads it: a copy would move it for nothing"
    if not site.activation:
        return "a graph input or user output: offloading it frees nothing"
    if _nbytes(site) < options.min_bytes:
        return "smaller than min_bytes"
    if dense_span(site.saved) is None:
        # NOTE: its host copy would be contiguous, and the backward was traced with its
        # own strides; a slice of a wider tensor is rare among saved activations.
        return "not dense (a slice of a wider tensor)"
    return None


def _subgraph(gm: torch.fx.GraphModule, call: torch.fx.Node) -> torch.fx.GraphModule | None:
    getter = call.args[0] if call.args else None
    if not isinstance(getter, torch.fx.Node) or getter.op != "get_attr":
        return None
    sub = getattr(gm, str(getter.target), None)
    return sub if isinstance(sub, torch.fx.GraphModule) else None


def _set_subgraph(gm: torch.fx.GraphModule, call: torch.fx.Node, sub: torch.fx.GraphModule) -> None:
    getter = call.args[0]
    assert isinstance(getter, torch.fx.Node)
    setattr(gm, str(getter.target), sub)


def _single_leaf(call: torch.fx.Node) -> torch.fx.Node:
    leaves = [u for u in call.users if u.target is operator.getitem]
    if len(leaves) != 1:
        raise AssertionError(f"{call.name}: expected one result, got {len(leaves)}")
    return leaves[0]


def _graph_module(inputs: Sequence[tuple[str, Any]], body: Any) -> torch.fx.GraphModule:
    """A subgraph ``(inputs...) -> (body(inputs...),)`` with example values in meta."""
    graph = torch.fx.Graph()
    nodes = []
    for name, val in inputs:
        node = graph.placeholder(name)
        node.meta["val"] = val
        nodes.append(node)
    out = body(graph, nodes)
    graph.output((out,))
    sub = torch.fx.GraphModule(torch.nn.Module(), graph)
    for node in sub.graph.nodes:
        node.meta.setdefault("loom_pass", "lower_offload")
    return sub


def _fake_call(op: OpOverload, like: torch.Tensor, *args: Any) -> torch.Tensor:
    """``op(like, *args)`` on fake values, in ``like``'s fake mode."""
    mode = fake_mode_of(like)
    with mode if mode is not None else contextlib.nullcontext():
        out = op(like, *args)
    assert isinstance(out, torch.Tensor)
    return out


def _keep(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, site: OffloadSite) -> None:
    """Both graphs become the identity: the saved tensor crosses to the backward as is."""
    saved = site.saved
    _replace_pack(forward, site, _graph_module([("saved", saved)], lambda g, x: x[0]), saved)
    if site.unpack_call is not None:
        sub = _graph_module([("packed", saved)], lambda g, x: x[0])
        _replace_unpack(backward, site, sub, saved, saved, ())


def _offload(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    site: OffloadSite,
    ahead: Sequence[OffloadSite],
    options: OffloadOptions,
) -> None:
    saved, window = site.saved, options.window_bytes
    host_val = _fake_call(offload_op, saved, window)

    def pack_body(g: torch.fx.Graph, x: list[torch.fx.Node]) -> torch.fx.Node:
        node = g.call_function(offload_op, (x[0], window))
        node.meta["val"] = host_val
        return node

    _replace_pack(forward, site, _graph_module([("saved", saved)], pack_body), host_val)
    assert site.unpack_call is not None  # a tensor the backward never reads is kept
    ahead_hosts = [_host_input(o) for o in ahead]
    # NOTE: what each host input will hold once its own site is lowered (maybe later).
    ahead_vals = [_fake_call(offload_op, o.saved, window) for o in ahead]
    device = saved.device
    reloaded = _fake_call(reload_op, host_val, device, ahead_vals)

    def unpack_body(g: torch.fx.Graph, x: list[torch.fx.Node]) -> torch.fx.Node:
        node = g.call_function(reload_op, (x[0], device, list(x[1:])))
        node.meta["val"] = reloaded
        return node

    inputs = [("packed", host_val)] + [(f"ahead_{i}", v) for i, v in enumerate(ahead_vals)]
    sub = _graph_module(inputs, unpack_body)
    _replace_unpack(backward, site, sub, host_val, reloaded, ahead_hosts)


def _replace_pack(
    forward: torch.fx.GraphModule, site: OffloadSite, sub: torch.fx.GraphModule, packed: Any
) -> None:
    """The pack call runs ``sub``, whose one result (``packed``) crosses to the backward."""
    _set_subgraph(forward, site.pack_call, sub)
    site.pack_call.meta["val"] = (packed,)
    _single_leaf(site.pack_call).meta["val"] = packed


def _host_input(site: OffloadSite) -> torch.fx.Node:
    """The backward input that holds ``site``'s packed value."""
    assert site.unpack_call is not None
    host = site.unpack_call.args[1]
    assert isinstance(host, torch.fx.Node)
    return host


def _replace_unpack(
    backward: torch.fx.GraphModule,
    site: OffloadSite,
    sub: torch.fx.GraphModule,
    packed: Any,
    unpacked: torch.Tensor,
    ahead: Sequence[torch.fx.Node],
) -> None:
    """The unpack call runs ``sub`` on the packed input (now ``packed``) and ``ahead``."""
    assert site.unpack_call is not None
    host = _host_input(site)
    host.meta["val"] = packed
    _set_subgraph(backward, site.unpack_call, sub)
    site.unpack_call.args = (site.unpack_call.args[0], host, *ahead)
    _set_unpacked(site.unpack_call, unpacked)


def _set_unpacked(call: torch.fx.Node, value: torch.Tensor) -> None:
    """The unpack call's result is now ``value``; a copy back to the saved strides
    that ``value`` already has is dropped."""
    call.meta["val"] = (value,)
    out = _single_leaf(call)
    out.meta["val"] = value
    for user in list(out.users):
        if user.target is torch.ops.prims.copy_strided.default and _same_strides(
            value, user.args[1]
        ):
            user.replace_all_uses_with(out)
            user.graph.erase_node(user)


def _same_strides(value: torch.Tensor, stride: Any) -> bool:
    if not isinstance(stride, (list, tuple)) or len(stride) != value.dim():
        return False
    return all(
        size == 1 or want == got
        for size, want, got in zip(value.shape, stride, value.stride(), strict=True)
    )


_LAYER = re.compile(r"(?:^|[._])(\d+)(?:$|[._])")


def layer_of(node: torch.fx.Node) -> str:
    """The ``nn.ModuleList`` item that made ``node`` (``"model.layers.3"``), or ``""``."""
    stack: Mapping[str, Any] | None = node.meta.get("nn_module_stack")
    if not stack:
        stack = node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    found = ""
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if _LAYER.search(str(path)):
            found = str(path)
            break
    return found


def _prefetch_schedule(
    reloaded: Sequence[OffloadSite], options: OffloadOptions
) -> dict[str, tuple[OffloadSite, ...]]:
    """For each site in backward order, the sites whose reloads start at its reload.

    The window after site ``k`` spans the next sites while their bytes stay within
    ``prefetch_bytes`` and their layers within ``prefetch_layers`` (always at least
    the next one); each site is started once, at the first reload whose window
    reaches it.
    """
    schedule: dict[str, tuple[OffloadSite, ...]] = {}
    started = 0  # sites [0, started) have been started
    for k, site in enumerate(reloaded):
        started = max(started, k + 1)
        end = k + 1
        nbytes = 0
        layers: set[str] = set()
        while end < len(reloaded):
            nxt = reloaded[end]
            more_layers = layers | {nxt.layer or nxt.name}
            if end > k + 1 and (
                nbytes + _nbytes(nxt) > options.prefetch_bytes
                or len(more_layers) > max(options.prefetch_layers, 1)
            ):
                break
            nbytes += _nbytes(nxt)
            layers = more_layers
            end += 1
        if options.prefetch_bytes == 0:
            end = k + 1
        schedule[site.name] = tuple(reloaded[started:end])
        started = max(started, end)
    return schedule
