"""The base of every ``loom_hops`` higher-order operator: ``op(subgraph, *operands)``.

A :class:`SubgraphHOP` means exactly ``subgraph(*operands)``: it invokes one FX
subgraph on a flat list of operands (tensors and symbolic sizes) and returns
the subgraph's flat tuple of outputs. Its rules for eager, fake tensors, proxy
tracing, functionalization and autograd are written once here, so an operator
is a two-line subclass. The node stays in the graph, a visible boundary, until
:func:`loom_hops.inline_subgraph_hops` copies the subgraph in place at codegen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.fx

from loom_hops._torch_compat import (
    DispatchKey,
    FakeTensorMode,
    HigherOrderOperator,
    ProxyTorchDispatchMode,
    below_autograd,
    pytree,
    reenter_make_fx,
    track_tensor_tree,
)

__all__ = ["FunctionalSubgraph", "SubgraphHOP", "subgraph_hops"]

Operand = torch.Tensor | torch.SymInt | int | float | bool

_REGISTRY: dict[str, SubgraphHOP] = {}


class FunctionalSubgraph:
    """A subgraph wrapped by functionalization (what the HOP's functional rule passes on)."""

    def __init__(self, fn: Callable[..., Any], source: torch.fx.GraphModule) -> None:
        self.fn = fn
        self.source = source

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


Subgraph = torch.fx.GraphModule | FunctionalSubgraph


class SubgraphHOP(HigherOrderOperator):  # type: ignore[misc]
    """A higher-order operator that calls one subgraph on its operands.

    Subclass it and instantiate once, with a unique name::

        class PackHook(SubgraphHOP):
            differentiable = False

        pack_hook = PackHook("loom_pack_hook")
        outs = pack_hook(pack_gm, x)        # == pack_gm(x), as a tuple

    Call tree of the rules (one per dispatch key, all defined here)::

        op(subgraph, *operands)
         ├─ Autograd            differentiable: inline subgraph under autograd
         │                      otherwise: below autograd, outputs need no grad
         ├─ Functionalize       functionalize the subgraph, redispatch
         ├─ ProxyTorchDispatch  trace the subgraph, emit one ``call_function`` node
         ├─ FakeTensorMode      run the subgraph on fake operands
         └─ CompositeExplicit   run the subgraph (eager)
    """

    #: Whether gradients flow through the operator (by dissolving it under autograd).
    differentiable: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        if name in _REGISTRY:
            raise ValueError(f"a SubgraphHOP named {name!r} already exists")
        super().__init__(name, cacheable=True)  # type: ignore[no-untyped-call]
        _REGISTRY[name] = self
        self.py_autograd_impl(self._call_autograd)
        self.py_functionalize_impl(self._call_functionalize)
        self.py_impl(ProxyTorchDispatchMode)(self._call_proxy)
        self.py_impl(FakeTensorMode)(self._call_fake)
        self.py_impl(DispatchKey.CompositeExplicitAutograd)(self._call_eager)

    def __call__(self, subgraph: Subgraph, *operands: Operand) -> tuple[Any, ...]:
        if not isinstance(subgraph, (torch.fx.GraphModule, FunctionalSubgraph)):
            raise TypeError(
                f"{self._name}: the subgraph must be a torch.fx.GraphModule, "
                f"got {type(subgraph).__name__}"
            )
        out = super().__call__(subgraph, *operands)  # type: ignore[no-untyped-call]
        return tuple(out)

    @staticmethod
    def _run(subgraph: Subgraph, operands: Sequence[Any]) -> tuple[Any, ...]:
        out = subgraph(*operands)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _call_eager(self, subgraph: Subgraph, *operands: Any) -> tuple[Any, ...]:
        return self._run(subgraph, operands)

    def _call_fake(
        self, mode: FakeTensorMode, subgraph: Subgraph, *operands: Any
    ) -> tuple[Any, ...]:
        with mode:
            return self._run(subgraph, operands)

    def _call_autograd(self, subgraph: Subgraph, *operands: Any) -> tuple[Any, ...]:
        if self.differentiable:
            return self._run(subgraph, operands)
        with below_autograd():
            out = self(subgraph, *operands)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)

    def _call_functionalize(self, ctx: Any, subgraph: Subgraph, *operands: Any) -> Any:
        unwrapped = ctx.unwrap_tensors(operands)
        source = subgraph.source if isinstance(subgraph, FunctionalSubgraph) else subgraph
        with ctx.redispatch_to_next():
            functional = FunctionalSubgraph(ctx.functionalize(subgraph), source)
            out = self(functional, *unwrapped)
        return ctx.wrap_tensors(out)

    def _call_proxy(
        self, mode: ProxyTorchDispatchMode, subgraph: Subgraph, *operands: Any
    ) -> tuple[Any, ...]:
        tracer: Any = mode.tracer
        traced = reenter_make_fx(lambda *a: self._run(subgraph, a))(*operands)
        qualname = tracer.get_fresh_qualname(f"{self._name}_subgraph")
        tracer.root.register_module(qualname, traced)
        proxy_args = pytree.tree_map(tracer.unwrap_proxy, (traced, *operands))
        out_proxy = tracer.create_proxy("call_function", self, proxy_args, {})
        out = self(subgraph, *operands)
        return track_tensor_tree(out, out_proxy, constant=None, tracer=tracer)  # type: ignore[no-any-return]


def subgraph_hops() -> tuple[SubgraphHOP, ...]:
    """Every :class:`SubgraphHOP` created so far (what the inlining pass looks for)."""
    return tuple(_REGISTRY.values())
