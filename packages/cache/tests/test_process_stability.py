"""Every key component is content-derived: two fresh processes with different
hash seeds compute the same digests for closures, values, Dynamo graphs and
full keys."""

from __future__ import annotations

from collections.abc import Callable

_PROGRAM = r"""
import torch
import loom_cache as lc

scale = 3
def make(k):
    def hook(t):
        return t * k + scale
    return hook

class Cfg:
    def __init__(self):
        self.name = "n"; self.sizes = {"b": 2, "a": 1}

graphs = []
def grab(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

def program(x, w, table):
    h = torch.nn.functional.gelu(x @ w)
    return h.sum(dim=-1) * table["scale"] + h.mean()

compiled = torch.compile(program, backend=grab, dynamic=True)
compiled(torch.randn(4, 8), torch.randn(8, 16), {"scale": 2.0, "bias": 1})
fp = lc.graph_fingerprint(graphs[0])
key = lc.make_key("prog", fp, device="cpu", backend=("loom", "0.1.0"),
                  options={"cudagraphs": False, "z": 1, "a": "x"},
                  extra=[lc.code_component("hooks", [make(2.5)])])
print(lc.function_digest(make(2.5)), lc.stable_digest({"z": 1, "a": (1.0, "x", None)}),
      lc.stable_digest(Cfg()), lc.stable_digest({"s", "t", "u"}),
      lc.stable_digest(torch.arange(4.0)), fp.digest, key.digest)
"""


def test_keys_are_equal_in_two_processes_with_different_hash_seeds(
    run_python_pair: Callable[..., tuple[str, str]],
) -> None:
    first, second = run_python_pair(_PROGRAM, ("1", "4242"))
    assert len(first.split()) == 7
    assert first == second
