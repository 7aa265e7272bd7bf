"""A minimal Dynamo backend for these tests: AOTAutograd + default partition + loom_hops.

It does what the umbrella's hooks stage does, without the umbrella: snapshot
the active pair, place it after the partitioner, inline before running the
graphs eagerly, and disable eager application at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

import loom_hops


@dataclasses.dataclass
class Compiled:
    placements: list[loom_hops.Placement | loom_hops.Unsupported] = dataclasses.field(
        default_factory=list
    )
    graphs: dict[str, str] = dataclasses.field(default_factory=dict)
    compiles: int = 0


def hooks_backend(
    scope: loom_hops.PackScope = loom_hops.PackScope.ALL,
    inline: bool = True,
    min_cut: bool = False,
) -> tuple[Callable[..., Any], Compiled]:
    log = Compiled()

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        log.compiles += 1
        pair = loom_hops.active_saved_tensors_hooks()
        graphs = None if pair is None else loom_hops.prepare_saved_tensors_hooks(pair)
        usable = None if isinstance(graphs, loom_hops.Unsupported) else graphs
        placed: list[loom_hops.Placement] = []

        def partition(joint: Any, inputs: Any, **kwargs: Any) -> Any:
            if min_cut:  # Inductor's partitioner: saves views it makes at the forward's end
                fw, bw = min_cut_rematerialization_partition(
                    joint, inputs, compiler="inductor", **kwargs
                )
            else:
                fw, bw = default_partition(joint, inputs, **kwargs)
            if usable is not None:
                placement = loom_hops.place_saved_tensor_hooks(
                    fw,
                    bw,
                    num_fwd_outputs=kwargs["num_fwd_outputs"],
                    hooks=usable,
                    scope=scope,
                    static_input_indices=kwargs.get("static_lifetime_input_indices") or (),
                )
                log.placements.append(placement)
                if isinstance(placement, loom_hops.Placement):
                    placed.append(placement)
                log.graphs["forward"] = fw.code
                log.graphs["backward"] = bw.code
            return fw, bw

        def compiler(g: torch.fx.GraphModule, _inputs: Any) -> Any:
            if inline:  # otherwise the HOPs run through their eager rule
                loom_hops.inline_subgraph_hops(g)
            return make_boxed_func(g.forward)

        def bw_compiler(g: torch.fx.GraphModule, inputs: Any) -> Any:
            fn = compiler(g, inputs)
            effects = placed[0].unpack_effects if placed else ()

            def run_bw(args: Any) -> Any:
                out = fn(args)
                for replay in effects:
                    replay(pair)
                return out

            run_bw._boxed_call = True  # type: ignore[attr-defined]
            return run_bw

        inner = aot_autograd(fw_compiler=compiler, bw_compiler=bw_compiler, partition_fn=partition)
        with loom_hops.native_hook_inlining_disabled(pair):
            compiled = inner(gm, example_inputs)
        loom_hops.install_hooks_guard(pair, usable)
        if usable is None or not placed:
            return compiled  # type: ignore[no-any-return]

        def run(*args: Any) -> Any:
            active = loom_hops.active_saved_tensors_hooks() or pair
            with loom_hops.eager_saved_tensors_hooks_disabled():
                out = compiled(*args)
            for replay in placed[0].pack_effects:
                replay(active)
            return out

        return run

    return backend, log
