"""Stable symbol names: from the source, not from creation order."""

from __future__ import annotations

import itertools

import torch

from loom_cache import graph_fingerprint, stable_symbol_names, symbol_id


def _colliding_sources() -> tuple[str, str]:
    seen: dict[int, str] = {}
    for i in itertools.count():
        name = f"L['t{i}'].size()[0]"
        sid = symbol_id(name)
        if sid in seen:
            return seen[sid], name
        seen[sid] = name
    raise AssertionError


def test_names_do_not_depend_on_creation_order_even_on_collision() -> None:
    a, b = _colliding_sources()
    forward = stable_symbol_names({"sa": a, "sb": b, "sc": "L['x'].size()[1]"})
    backward = stable_symbol_names({"sc": "L['x'].size()[1]", "sb": b, "sa": a})
    assert forward == backward
    assert len(set(forward.values())) == 3


def test_dropping_a_symbol_keeps_the_names_of_the_others() -> None:
    full = stable_symbol_names(
        {"x0": "L['x'].size()[0]", "y0": "L['y'].size()[0]", "z0": "L['z'].size()[0]"}
    )
    fewer = stable_symbol_names({"x0": "L['x'].size()[0]", "z0": "L['z'].size()[0]"})
    assert fewer == {"x0": full["x0"], "z0": full["z0"]}


def test_unsourced_symbols_are_numbered_by_first_appearance() -> None:
    names = stable_symbol_names({"s": "L['x'].size()[0]"}, ["u7", "u3"])
    assert names["u7"] == "u0" and names["u3"] == "u1"


def _fingerprint(over_mark: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
    graphs: list[torch.fx.GraphModule] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    def program(x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # mask's length is specialized by this branch: a symbol marked for it disappears.
        if mask.shape[0] == 3:
            return x.sum(0) * 2 + y.sum()
        return x.sum(0) - y.sum()

    torch._dynamo.reset()
    x, mask, y = torch.randn(5, 4), torch.ones(3), torch.randn(6)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    if over_mark:  # what an automatic-dynamic profile that over-marks does
        torch._dynamo.maybe_mark_dynamic(mask, 0)
    torch.compile(program, backend=grab)(x, mask, y)
    fp = graph_fingerprint(graphs[-1])
    return fp.digest, fp.symbols


def test_over_marked_dynamic_dimension_that_gets_specialized_still_hits() -> None:
    plain_digest, plain_symbols = _fingerprint(over_mark=False)
    over_digest, over_symbols = _fingerprint(over_mark=True)
    assert [src for _, src in plain_symbols] == ["L['x'].size()[0]", "L['y'].size()[0]"]
    assert over_symbols == plain_symbols
    assert over_digest == plain_digest
