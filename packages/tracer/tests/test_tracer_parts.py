"""The tracer's parts: registry, graph form, output layout, guards, replay-plan checks,
fingerprint stability, version knowledge and the refusal doc page."""

from __future__ import annotations

import dis
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from loom_sidefx import Computed, OpKind, Original, TensorSlot
from loom_tracer import (
    GuardKind,
    HookUnsupported,
    ReplayPlan,
    TensorMeta,
    TracedHook,
    TraceRefusalKind,
    _frame,
    _pyversion,
    trace_hook,
)
from loom_tracer._frame import HANDLERS, handles

sys.path.insert(0, str(Path(__file__).parent))
import corpus

ROOT = Path(__file__).resolve().parents[3]


def traced(fn: Any, *args: Any) -> TracedHook:
    result = trace_hook(fn, args)
    assert isinstance(result, TracedHook), str(result)
    return result


# ------------------------------------------------------------------ registry


def test_an_opcode_this_python_lacks_is_skipped_and_recorded(monkeypatch: Any) -> None:
    monkeypatch.setattr(_frame, "UNAVAILABLE", [])
    handles("NOT_AN_OPCODE")(lambda frame, inst: None)
    assert _frame.UNAVAILABLE == ["NOT_AN_OPCODE"] and "NOT_AN_OPCODE" not in HANDLERS


def test_every_handler_declared_for_this_python_registered() -> None:
    # dis is the authority: a flag that names an opcode this Python lacks is a bug here.
    assert _pyversion.BYTECODE_KNOWN, f"no tests run on CPython {_pyversion.PY_VERSION}"
    assert _frame.UNAVAILABLE == []


def test_registering_an_opcode_twice_fails() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        handles("LOAD_FAST")(lambda frame, inst: None)


def test_every_opcode_the_corpus_compiles_to_has_a_handler() -> None:
    refused_ops = {"IMPORT_NAME"}  # the corpus' unsupported-opcode case
    missing: set[str] = set()

    def visit(code: types.CodeType) -> None:
        for inst in dis.get_instructions(code):
            if inst.opname not in HANDLERS and inst.opname not in refused_ops:
                missing.add(inst.opname)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit(const)

    for fn in vars(corpus).values():
        if inspect.isfunction(fn) and fn.__module__ == corpus.__name__:
            visit(fn.__code__)
    # Exception-path opcodes never run on a trace that returns normally.
    missing -= {
        "PUSH_EXC_INFO",
        "WITH_EXCEPT_START",
        "RERAISE",
        "POP_EXCEPT",
        "CHECK_EXC_MATCH",
        "CLEANUP_THROW",
    }
    assert not missing


def test_an_opcode_without_handler_is_refused_with_its_line() -> None:
    def hook(t):
        import math  # an import inside the hook

        return t * math.pi

    result = trace_hook(hook, (torch.ones(2),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_OPCODE
    assert "IMPORT_NAME" in result.explanation
    assert result.where == f"test_tracer_parts.py:{hook.__code__.co_firstlineno + 1}"


# ------------------------------------------------------------------- graphs


def test_graph_is_aten_level_and_functional() -> None:
    def hook(t):
        y = t.clone()
        y.mul_(2)
        y[0] = 0.0
        return torch.nn.functional.relu(y)

    gm = traced(hook, torch.randn(3, 2)).graph
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets
    for target in targets:
        assert isinstance(target, torch._ops.OpOverload), target
        assert not target._schema.is_mutable, target


def test_user_outputs_come_first_then_side_effect_slots() -> None:
    log: list[Any] = []

    def hook(t):
        log.append(t.amax())
        return (t.dtype, t * 2)

    x = torch.randn(4)
    tr = traced(hook, x)
    assert tr.num_user_outputs == 1
    assert tr.num_effect_outputs == 1
    outputs = tr.graph(*tr.graph_inputs(x))
    assert torch.equal(outputs[0], x * 2)
    assert torch.equal(outputs[1], x.amax())
    (append,) = tr.replay.ops
    assert append.kind is OpKind.LIST_APPEND and append.args == (TensorSlot(1),)
    result = tr.replay_outputs(outputs, (x,))
    assert result[0] is torch.float32 and torch.equal(result[1], x * 2)
    assert len(log) == 1 and torch.equal(log[0], x.amax())


def test_hook_traced_on_fake_tensors_runs_on_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def pack(t):
        return (t.dtype, t.to(torch.bfloat16))

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(8, 4)
    tr = traced(pack, fake)
    real = torch.randn(8, 4)
    assert tr.check_guards(real)
    dtype, data = tr.run(real)
    assert dtype is torch.float32 and torch.equal(data, real.to(torch.bfloat16))


def test_fx_wrapped_function_is_an_opaque_call() -> None:
    tr = traced(_uses_wrapped, torch.ones(3))
    assert tr.opaque
    assert torch.equal(tr.run(torch.ones(3)), torch.ones(3) * 7)


@torch.fx.wrap
def _wrapped_scale(t: torch.Tensor) -> torch.Tensor:
    return t * 7


def _uses_wrapped(t: torch.Tensor) -> torch.Tensor:
    return _wrapped_scale(t)


# -------------------------------------------------------------------- guards


def test_guard_function_rejects_changed_metadata_and_missing_sources() -> None:
    def hook(t):
        return t * 2

    x = torch.randn(2, 3)
    tr = traced(hook, x)
    assert tr.check_guards(x)
    assert not tr.check_guards(x.double())
    assert not tr.check_guards(x.t())  # same numel, other shape and strides
    assert not tr.check_guards(x.requires_grad_())
    assert not tr.check_guards("not a tensor")
    assert not tr.check_guards()  # the argument is missing: False, not IndexError


def test_counter_update_needs_no_guard_on_its_value() -> None:
    hook = corpus._make_counting_pack()
    tr = traced(hook, torch.ones(2))
    assert all(g.kind is not GuardKind.EQUALS for g in tr.guards), [g.describe() for g in tr.guards]
    tr.run(torch.ones(2))
    tr.run(torch.ones(2))
    assert hook.__closure__ is not None and hook.__closure__[0].cell_contents == 2


def test_shadowing_a_builtin_after_tracing_fails_the_guard() -> None:
    ns: dict[str, Any] = {"__builtins__": __builtins__, "torch": torch}
    exec("def hook(t):\n    return t * len(t.shape)\n", ns)
    hook = ns["hook"]
    tr = traced(hook, torch.ones(2, 2))
    assert tr.check_guards(torch.ones(2, 2))
    ns["len"] = lambda x: 5
    assert not tr.check_guards(torch.ones(2, 2))


def test_the_same_list_reached_two_ways_is_guarded_as_aliased() -> None:
    shared: list[int] = []
    ns: dict[str, Any] = {"A": shared, "B": shared}
    exec("def hook(t):\n    A.append(1)\n    B.append(len(A))\n    return t\n", ns)
    tr = traced(ns["hook"], torch.ones(1))
    assert tr.check_guards(torch.ones(1))
    ns["B"] = []
    assert not tr.check_guards(torch.ones(1))


# ------------------------------------------------------------- replay plans


def test_a_traced_hook_replays_through_a_loom_sidefx_plan() -> None:
    counts: dict[str, Any] = {"calls": 0}

    def hook(t):
        counts["calls"] += 1
        return t + 1

    tr = traced(hook, torch.ones(2))
    assert isinstance(tr.replay, ReplayPlan)
    tr.replay.check()
    (store,) = tr.replay.ops
    assert store.kind is OpKind.DICT_SETITEM and store.key == "calls"
    (count,) = store.args
    assert isinstance(count, Computed) and count.op == "+" and isinstance(count.lhs, Original)
    out = tr.run(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and counts == {"calls": 1}


# -------------------------------------------------------------- fingerprint

_FINGERPRINT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import corpus
    from loom_tracer import trace_hook
    out = []
    for name in ("quantize_fp8_by_dtype", "counter_in_closure", "shapes_appended_to_global_list",
                 "set_of_seen_dtypes", "list_subclass_with_overridden_append"):
        case = next(c for c in corpus.CASES if c.name == name)
        s = case.build()
        out.append(trace_hook(s.hook, s.args).fingerprint)
    print(",".join(out))
    """
)


def test_fingerprint_is_identical_in_two_fresh_processes() -> None:
    script = _FINGERPRINT_SCRIPT.format(tests=str(Path(__file__).parent))
    runs = []
    for seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        runs.append(proc.stdout.strip())
    assert runs[0] == runs[1]
    assert len(set(runs[0].split(","))) == 5


def test_fingerprint_changes_with_guarded_values_and_code() -> None:
    a = corpus.quantize_bf16_by_size()
    b = corpus.quantize_bf16_by_size()
    b.hook.__globals__["THRESHOLD"] = 100
    fa = traced(a.hook, *a.args).fingerprint
    fb = traced(b.hook, *b.args).fingerprint
    assert fa != fb


# --------------------------------------------------------- version and docs


def test_python_version_checks_live_only_in_pyversion() -> None:
    src = ROOT / "packages" / "tracer" / "src" / "loom_tracer"
    offenders = [
        p.name
        for p in src.rglob("*.py")
        if p.name != "_pyversion.py" and "version_info" in p.read_text()
    ]
    assert not offenders


# A CPython the tracer does not know (3.15, as far as its _pyversion can tell), where
# the hook's first opcode was renamed (this Python's dis lacks the name the tracer
# registers). The rest of the process (torch, the standard library) sees the real one.
_UNKNOWN_PYTHON_SCRIPT = textwrap.dedent(
    """
    import dis, importlib.util, json, pathlib, sys
    import torch

    def pack(t):
        return t.to(torch.bfloat16)

    renamed = next(i.opname for i in dis.get_instructions(pack) if i.opname != "RESUME")
    del dis.opmap[renamed]
    folder = pathlib.Path(importlib.util.find_spec("loom_tracer").origin).parent
    spec = importlib.util.spec_from_file_location("loom_tracer._pyversion", folder / "_pyversion.py")
    pyversion = importlib.util.module_from_spec(spec)
    real, sys.version_info = sys.version_info, (3, 15, 0, "alpha", 0)
    try:
        spec.loader.exec_module(pyversion)
    finally:
        sys.version_info = real
    sys.modules[spec.name] = pyversion
    import loom_tracer
    from loom_tracer import _frame
    result = loom_tracer.trace_hook(pack, (torch.randn(4),))
    print(json.dumps({
        "renamed": renamed,
        "unavailable": _frame.UNAVAILABLE,
        "kind": result.kind.value,
        "where": result.where,
        "explanation": result.explanation,
    }))
    """
)


def test_an_unknown_python_imports_and_refuses_hooks_naming_version_and_opcode() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNKNOWN_PYTHON_SCRIPT], capture_output=True, text=True, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["renamed"] in got["unavailable"]  # skipped at registration, no error
    assert got["kind"] == "unsupported_python"
    assert got["where"] == "<string>:6"  # the line of the renamed opcode
    assert "CPython 3.15" in got["explanation"]
    assert f"first opcode unknown to the tracer is {got['renamed']}" in got["explanation"]


def test_every_refusal_kind_is_documented() -> None:
    doc = (ROOT / "docs" / "tracer.md").read_text()
    missing = [k.name for k in TraceRefusalKind if f"`{k.name}`" not in doc]
    assert not missing


def test_lists_that_were_distinct_while_tracing_must_stay_distinct() -> None:
    ns: dict[str, Any] = {"A": [], "B": []}
    exec("def hook(t):\n    A.append(1)\n    return t * len(B)\n", ns)
    tr = traced(ns["hook"], torch.ones(1))
    assert tr.check_guards(torch.ones(1))
    ns["B"] = ns["A"]  # now len(B) would see the append: the trace no longer applies
    assert not tr.check_guards(torch.ones(1))


def test_attribute_store_on_a_list_is_refused_not_replayed() -> None:
    ns: dict[str, Any] = {"A": []}
    exec("def hook(t):\n    A.note = 1\n    return t\n", ns)
    result = trace_hook(ns["hook"], (torch.ones(1),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT


def test_operator_setitem_on_a_python_list_is_refused() -> None:
    import operator

    ns: dict[str, Any] = {"A": [0], "operator": operator}
    exec("def hook(t):\n    operator.setitem(A, 0, 5)\n    return t\n", ns)
    result = trace_hook(ns["hook"], (torch.ones(1),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_CALL


def _symbolic_fake(*sizes: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (len(sizes) - 1)
    context = StatelessSymbolicContext(dynamic_sizes=dynamic)
    return mode.from_tensor(torch.randn(*sizes), symbolic_context=context)


def test_symbolic_sizes_flow_into_tensor_ops_and_the_graph_serves_other_sizes() -> None:
    def pack(t):
        n = t.shape[0] * t.size(1)
        return (t.dtype, t.reshape(n).to(torch.bfloat16), t[: len(t) // 2])

    tr = traced(pack, _symbolic_fake(8, 4))
    assert any(
        g.kind is GuardKind.PREDICATE and isinstance(g.expected, TensorMeta) and "?" in g.describe()
        for g in tr.guards
    )
    for rows in (8, 5):
        x = torch.randn(rows, 4)
        assert tr.check_guards(x)
        dtype, data, half = tr.run(x)
        assert dtype is torch.float32 and torch.equal(data, x.reshape(-1).to(torch.bfloat16))
        assert torch.equal(half, x[: rows // 2])
    assert not tr.check_guards(torch.randn(8, 3))  # the static dimension is guarded


def test_branch_on_a_symbolic_size_is_refused() -> None:
    def pack(t):
        if t.numel() > 16:
            return t.to(torch.bfloat16)
        return t

    result = trace_hook(pack, (_symbolic_fake(8, 4),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_VALUE
    assert "symbolic size" in result.explanation


def test_isinstance_of_a_symbolic_size_is_refused_not_answered_wrongly() -> None:
    def pack(t):
        return t * 2 if isinstance(t.shape[0], int) else t

    result = trace_hook(pack, (_symbolic_fake(8, 4),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_VALUE


def test_storing_a_symbolic_size_in_python_state_is_refused() -> None:
    shapes: list[Any] = []

    def pack(t):
        shapes.append(t.shape[0])
        return t

    result = trace_hook(pack, (_symbolic_fake(8, 4),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT


class _SizedList(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 99


def test_container_subclass_overriding_len_is_refused() -> None:
    ns: dict[str, Any] = {"L": _SizedList()}
    exec("def hook(t):\n    return t * len(L)\n", ns)
    result = trace_hook(ns["hook"], (torch.ones(1),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.UNSUPPORTED_VALUE
    assert "__len__" in result.explanation


def test_three_lists_get_pairwise_distinctness_guards() -> None:
    ns: dict[str, Any] = {"A": [], "B": [], "C": []}
    exec("def hook(t):\n    A.append(len(B) + len(C))\n    return t\n", ns)
    tr = traced(ns["hook"], torch.ones(1))
    assert sum(g.kind is GuardKind.DISTINCT_FROM for g in tr.guards) == 3
    ns["C"] = ns["B"]
    assert not tr.check_guards(torch.ones(1))


def test_replacing_a_method_on_the_class_fails_the_guard() -> None:
    class Recorder:
        def record(self, x: Any) -> int:
            return 1

    ns: dict[str, Any] = {"R": Recorder()}
    exec("def hook(t):\n    return t * R.record(t)\n", ns)
    tr = traced(ns["hook"], torch.ones(1))
    assert tr.check_guards(torch.ones(1))
    Recorder.record = lambda self, x: 2  # type: ignore[method-assign]
    assert not tr.check_guards(torch.ones(1))


class _Offloader:
    def __init__(self) -> None:
        self.packed = 0

    def pack(self, t: torch.Tensor) -> Any:
        self.packed += 1
        return (t.device, t.to("cpu"))


def test_bound_method_hook_is_traced_with_self_as_state() -> None:
    eager, via_trace = _Offloader(), _Offloader()
    x = torch.randn(3)
    expected = eager.pack(x)
    tr = traced(via_trace.pack, x)
    actual = tr.run(x)
    assert expected[0] == actual[0] and torch.equal(expected[1], actual[1])
    assert eager.packed == via_trace.packed == 1


# ------------------------------------------------------------- closure cells


def test_a_cell_shared_by_the_hook_and_a_helper_is_one_model() -> None:
    hook = corpus._make_hook_and_helper_sharing_a_cell()
    tr = traced(hook, torch.ones(2))
    cell_guards = [g.describe() for g in tr.guards if "cell_contents" in g.describe()]
    assert cell_guards == [
        "closure[0:bump].cell_contents is <function object>",
        "type(closure[1:n].cell_contents) is int",  # a graph input (a lifted int)
    ], "the helper's read and write go through the hook's closure[1:n], not a second model"
    assert tr.replay.describe().splitlines()[1] == (
        "  closure[1:n].cell_contents = (closure[1:n].cell_contents + 1)"
    )
    before, after = tr.run(torch.ones(2))
    assert (before.tolist(), after.tolist()) == ([1.0, 1.0], [2.0, 2.0])
    assert hook.__closure__ is not None and hook.__closure__[1].cell_contents == 2


def test_a_new_cell_shared_by_two_nested_functions_stays_symbolic() -> None:
    tr = traced(corpus.h_new_cell_shared_by_two_nested, torch.ones(4, 3))
    assert tr.replay.ops == () and tr.replay.new_objects == ()
    assert not any("cell_contents" in g.describe() for g in tr.guards)
    first, second = tr.run(torch.ones(4, 3))
    assert (first[0, 0].item(), second[0, 0].item()) == (7.0, 8.0)


def test_nested_locals_and_cells_never_write_the_outer_cell_they_shadow() -> None:
    hook = corpus._make_shadowing()
    tr = traced(hook, torch.ones(2))
    assert tr.replay.describe().splitlines()[1:] == [
        "  closure[0:x].cell_contents = ((closure[0:x].cell_contents + 100) + 6)",
        "  return t0",
    ]
    assert tr.run(torch.ones(2)).tolist() == [108.0, 108.0]
    assert hook.__closure__ is not None and hook.__closure__[0].cell_contents == 108


def test_a_closure_over_a_new_cell_escaping_into_state_is_refused_naming_the_cell() -> None:
    holder: list[Any] = []
    hook = corpus.with_globals(corpus._closure_escapes, HOLDER=holder)
    result = trace_hook(hook, (torch.ones(2),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.ESCAPING_FUNCTION
    assert "'rescale'" in result.explanation and "(scale)" in result.explanation
    assert holder == [], "tracing performs no side effect"


def test_reading_an_empty_cell_made_by_the_hook_is_refused_as_the_hook_raising() -> None:
    def hook(t):
        def read():
            return late

        out = read()
        late = t
        return out

    result = trace_hook(hook, (torch.ones(2),))
    assert isinstance(result, HookUnsupported)
    assert result.kind is TraceRefusalKind.HOOK_RAISES
    assert "'late' referenced before assignment" in result.explanation
    with pytest.raises(NameError):
        hook(torch.ones(2))


def test_tensors_inside_a_returned_new_container_are_user_outputs() -> None:
    log: list[Any] = []

    def hook(t):
        out = {"scaled": [t * 2]}
        log.append(t.amax())
        out["scaled"].append(t + 1)
        return out

    x = torch.randn(4)
    tr = traced(hook, x)
    assert (tr.num_user_outputs, tr.num_effect_outputs) == (2, 1)
    outputs = tr.graph(*tr.graph_inputs(x))
    result = tr.replay_outputs(outputs, (x,))
    assert list(result) == ["scaled"]
    assert torch.equal(result["scaled"][0], x * 2) and torch.equal(result["scaled"][1], x + 1)
    assert len(log) == 1 and torch.equal(log[0], x.amax())


def test_container_state_is_the_side_effect_logs_view() -> None:
    """Reads after a mutation see the log's symbolic state; the plan replays it."""
    state: dict[str, Any] = {"seen": [1], "tags": {"a"}}

    def hook(t):
        seen = state["seen"]
        seen.append(len(seen))
        seen.insert(0, t * 3)
        state["tags"].add("b")
        state["n"] = len(seen) + len(state["tags"])
        cycle: list[Any] = []
        cycle.append(cycle)
        state["cycle"] = cycle
        return seen[0] + seen.pop()

    x = torch.randn(3)
    tr = traced(hook, x)
    assert state == {"seen": [1], "tags": {"a"}}  # tracing changes nothing
    out = tr.replay_outputs(tr.graph(*tr.graph_inputs(x)), (x,))
    assert torch.equal(out, x * 3 + 1)
    assert torch.equal(state["seen"][0], x * 3) and state["seen"][1:] == [1]
    assert state["tags"] == {"a", "b"} and state["n"] == 5
    assert state["cycle"][0] is state["cycle"]
