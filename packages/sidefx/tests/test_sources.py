"""Sources reach pre-existing objects from a hook's roots and describe themselves."""

from __future__ import annotations

import types

import pytest

from loom_sidefx import (
    ArgSource,
    AttrSource,
    CellContentsSource,
    ClosureSource,
    FunctionClosureSource,
    GlobalSource,
    ItemSource,
    Roots,
)


def make_hook() -> types.FunctionType:
    table = {"w": [1, 2]}

    def hook(x: object) -> object:
        return table, x

    return hook  # type: ignore[return-value]


def test_every_source_reconstructs_from_live_roots() -> None:
    hook = make_hook()

    class Holder:
        def __init__(self) -> None:
            self.value = "v"

    roots = Roots.of(hook, (Holder(),))
    roots.globals["helper"] = hook
    table = CellContentsSource(ClosureSource(0, "table"))
    assert table.reconstruct(roots) == {"w": [1, 2]}
    assert ItemSource(ItemSource(table, "w"), 1).reconstruct(roots) == 2
    assert AttrSource(ArgSource(0), "value").reconstruct(roots) == "v"
    assert GlobalSource("helper").reconstruct(roots) is hook
    via_fn = FunctionClosureSource(GlobalSource("helper"), 0, "table")
    assert via_fn.reconstruct(roots) is hook.__closure__[0]  # type: ignore[index]
    assert via_fn.root() == GlobalSource("helper")


def test_descriptions_are_python_like_and_address_free() -> None:
    src = AttrSource(ItemSource(CellContentsSource(ClosureSource(0, "stats")), "k"), "counts")
    assert src.describe() == "closure[0:stats].cell_contents['k'].counts"
    assert str(ArgSource(1)) == "args[1]"
    assert FunctionClosureSource(GlobalSource("f"), 2, "n").describe() == "G['f'].__closure__[2:n]"


def test_sources_are_hashable_values() -> None:
    assert {GlobalSource("a"), GlobalSource("a"), ItemSource(GlobalSource("a"), 0)} == {
        GlobalSource("a"),
        ItemSource(GlobalSource("a"), 0),
    }


def test_roots_of_takes_a_plain_def_and_refuses_what_is_not_a_python_function() -> None:
    def hook(x: int) -> int:
        return x

    assert Roots.of(hook, (1,)).args == (1,)
    with pytest.raises(
        TypeError, match=r"Roots\.of: <built-in function len>.*not a Python function"
    ):
        Roots.of(len, ())
