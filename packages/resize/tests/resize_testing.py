"""Helpers of the loom_resize tests: hand-built aten graphs, zero-storage
tensors, and a Dynamo backend that runs the resize passes around AOTAutograd
with eager codegen while recording what it saw."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

import loom_resize
import loom_sidefx
from loom_resize import _torch_compat as compat


@dataclasses.dataclass
class Recorder:
    """What the test backend saw and did for the last compiled graphs."""

    remove_chains: bool = True
    graphs: dict[str, GraphModule] = dataclasses.field(default_factory=dict)
    results: list[loom_sidefx.PassResult[torch.fx.GraphModule]] = dataclasses.field(
        default_factory=list
    )

    def backend(self) -> Callable[[GraphModule, list[Any]], Any]:
        def aten_passes(kind: str) -> Callable[[GraphModule, Any], Any]:
            def compiler(gm: GraphModule, example_inputs: Any) -> Any:
                if self.remove_chains:
                    self.results.append(loom_resize.remove_resize_copy_resize(gm))
                self.results.append(loom_resize.move_shrinks_after_last_use(gm))
                self.graphs[kind] = gm
                return gm.forward

            return compiler

        aot = compat.aot_eager_backend(aten_passes("forward"), aten_passes("backward"))

        def backend(gm: GraphModule, example_inputs: list[Any]) -> Any:
            self.results.append(loom_resize.rewrite_fills_as_fsdp_copy(gm))
            self.graphs["dynamo"] = gm
            return aot(gm, example_inputs)

        return backend

    def code(self, kind: str) -> str:
        return self.graphs[kind].code

    def changes(self) -> list[str]:
        return [line for r in self.results for line in r.lines()]


RESIZE = torch.ops.inductor.resize_storage_bytes_.default
aten = torch.ops.aten


def fsdp_copy() -> Any:
    return compat.fsdp_copy()


def empty_param(*shape: int, seed: int = 0) -> torch.Tensor:
    """A tensor with the given shape and zero bytes of storage (an unsharded FSDP param)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    t.untyped_storage().resize_(0)
    return t


class GraphBuilder:
    """Hand-built aten graphs whose placeholders carry example values."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()

    def input(self, name: str, value: torch.Tensor, *, dynamo: bool = False) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta["example_value" if dynamo else "val"] = value
        return node

    def inputs(self, names: tuple[str, ...], values: list[torch.Tensor]) -> list[torch.fx.Node]:
        return [self.input(n, v) for n, v in zip(names, values, strict=True)]

    def call(self, target: Any, *args: Any) -> torch.fx.Node:
        return self.graph.call_function(target, args)

    def resize(self, node: torch.fx.Node, nbytes: int) -> torch.fx.Node:
        return self.call(RESIZE, node, nbytes)

    def build(self, *outputs: Any) -> GraphModule:
        self.graph.output(tuple(outputs))
        return GraphModule(torch.nn.Module(), self.graph)


def targets(gm: GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step of an FSDPPatternStack: what eager and compiled must agree on."""

    out: torch.Tensor
    x_grad: torch.Tensor
    weight_grads: tuple[torch.Tensor, ...]
    nbytes_after_forward: tuple[int, ...]
    nbytes_after_backward: tuple[int, ...]


def train_steps(
    model: loom_resize.FSDPPatternStack,
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    steps: int = 2,
) -> list[Step]:
    """Run forward, the FSDP-style backward protocol and backward ``steps`` times."""
    result = []
    for _ in range(steps):
        x.grad = None
        for w in model.weights:
            w.grad = None
        out = forward(x)
        after_forward = tuple(model.storage_nbytes())
        model.prepare_backward(out)
        out.sum().backward()
        assert x.grad is not None
        result.append(
            Step(
                out.detach().clone(),
                x.grad.clone(),
                tuple(w.grad.clone() for w in model.weights if w.grad is not None),
                after_forward,
                tuple(model.storage_nbytes()),
            )
        )
    return result


def assert_same_steps(got: list[Step], want: list[Step]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.out, w.out)
        torch.testing.assert_close(g.x_grad, w.x_grad)
        assert len(g.weight_grads) == len(w.weight_grads) == len(w.nbytes_after_forward)
        for a, b in zip(g.weight_grads, w.weight_grads, strict=True):
            torch.testing.assert_close(a, b)
        assert g.nbytes_after_forward == w.nbytes_after_forward
        assert g.nbytes_after_backward == w.nbytes_after_backward
