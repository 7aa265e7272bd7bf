"""The offload step: placed hook pairs that move saved tensors to the host, lowered.

After :func:`torchloom._hooks.place_hooks`, each packed tensor whose pair moves it
to another device is a site for :func:`loom_offload.lower_offload`, which turns
its pack and unpack graphs into overlapped transfers (or the identity, where
offloading would free nothing) and says what it did for each; the report gets one
``offload`` entry per graph.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch.fx import GraphModule, Node

import loom_hops
from torchloom._values import Snapshot

if TYPE_CHECKING:
    import loom_offload

__all__ = ["lower_offload_step", "offload_options", "register_offload_operators"]

log = logging.getLogger("torchloom.offload")


def register_offload_operators() -> None:
    """Import ``loom_offload`` (its operators registered with torch and Inductor): before
    a graph under saved-tensor hooks compiles or is served from a cache, whose code may
    call them. Graphs without hooks never pay for it."""
    import loom_offload

    loom_offload.ensure_inductor_lowerings()


def offload_options(snapshot: Snapshot) -> loom_offload.OffloadOptions:
    """The lowering's options, from the resolved ``offload_*`` options."""
    import loom_offload

    o = snapshot.options
    return loom_offload.OffloadOptions(
        min_bytes=o.offload_min_bytes,
        window_bytes=o.offload_window_bytes,
        prefetch_bytes=o.offload_prefetch_bytes,
        prefetch_layers=o.offload_prefetch_layers,
    )


def lower_offload_step(
    snapshot: Snapshot, placement: loom_hops.Placement, fw: GraphModule, bw: GraphModule
) -> loom_offload.OffloadPlan | None:
    """Lower the placement's offload pairs in ``fw``/``bw`` (in place); ``None`` when
    nothing moves or the ``offload`` option is off."""
    if not placement.moved:
        return None
    if not snapshot.options.offload:
        snapshot.record.add_entry(
            "offload", "off", "offload is off: the hooks' own copies run as traced"
        )
        return None
    if snapshot.options.cudagraphs:
        # NOTE: the offload operators keep a host pool and events outside any graph;
        # the hooks' own copies are capturable and run as traced inside the segments.
        snapshot.record.add_entry(
            "offload",
            "not_lowered",
            "cudagraphs is on: the hooks' own copies run as traced (offload operators "
            "are not capturable)",
        )
        return None
    import loom_offload

    sites = _sites(placement, fw, bw)
    plan = loom_offload.lower_offload(fw, bw, sites, offload_options(snapshot))
    snapshot.record.add_plan("offload.plan", plan)
    snapshot.record.add_entry(
        "offload",
        "lowered",
        plan.summary(),
        offloaded=tuple(d.name for d in plan.offloaded),
        offloaded_bytes=plan.offloaded_bytes,
        not_offload=tuple(
            f"{d.name}: {d.reason}" for d in plan.decisions if d.action == "not_offload"
        ),
    )
    log.debug("graph %d: offload %s", snapshot.graph_id, plan.summary())
    return plan


def _sites(
    placement: loom_hops.Placement, fw: GraphModule, bw: GraphModule
) -> list[loom_offload.OffloadSite]:
    import loom_offload

    fw_nodes = {n.name: n for n in fw.graph.nodes}
    bw_nodes = {n.name: n for n in bw.graph.nodes}
    sites: list[loom_offload.OffloadSite] = []
    for packed in placement.packed:
        if not packed.moves_device or len(packed.crossing) != 1:
            continue
        leaf = fw_nodes.get(packed.crossing[0])
        saved = fw_nodes.get(packed.name)
        if leaf is None or saved is None or not isinstance(leaf.args[0], Node):
            continue
        pack_call = leaf.args[0]
        unpack_call = _unpack_call(bw_nodes.get(packed.crossing[0]))
        operand = pack_call.args[1] if len(pack_call.args) > 1 else None
        val = operand.meta.get("val") if isinstance(operand, Node) else None
        if val is None:
            continue
        sites.append(
            loom_offload.OffloadSite(
                name=packed.name,
                pack_call=pack_call,
                unpack_call=unpack_call,
                saved=val,
                activation=packed.origin is loom_hops.SavedOrigin.ACTIVATION,
                layer=loom_offload.layer_of(saved),
            )
        )
    return sites


def _unpack_call(host: Node | None) -> Node | None:
    if host is None:
        return None
    calls = [u for u in host.users if u.target is loom_hops.unpack_hook_op]
    return calls[0] if len(calls) == 1 else None
