"""Plan and guard text is identical in two fresh interpreters (no addresses, no hash order)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from loom_sidefx import *
class Rec: pass
g = {"log": [], "seen": {"a", "b"}, "rec": Rec()}
se = SideEffects()
log = se.track_existing(g["log"], GlobalSource("log"))
d = se.track_new(ObjKind.DICT, {"z": 1, "a": se.new_tensor_slot()})
s = se.track_new(ObjKind.SET, ["q", "b", "x"])
se.dict_setitem(d, "s", s)
se.list_append(log, d)
se.set_add(se.track_existing(g["seen"], GlobalSource("seen")), "c")
r = se.track_new(ObjKind.OBJECT, cls=Rec)
se.store_attr(se.track_existing(g["rec"], GlobalSource("rec")), "child", r)
plan = se.build()
print(plan.describe())
print(plan.program_text())
print(compile_guards([constant_guard(GlobalSource("rec"), g["rec"]), Guard(GuardKind.LENGTH, GlobalSource("log"), 0)]).__doc__)
"""


def _run(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, check=True, capture_output=True, text=True
    ).stdout


def test_describe_is_identical_across_processes_and_hash_seeds() -> None:
    first = _run("1")
    assert first == _run("2")
    assert "0x" not in first
    assert "n1 = new set{'q', 'b', 'x'}" in first
