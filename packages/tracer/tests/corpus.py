"""A corpus of hooks for the hook tracer, each checked against CPython running it.

Every case is a ``build()`` that returns a fresh ``Setup`` (a hook, its
arguments and the objects it may touch), so the eager run and the traced run
each work on their own copy of the state. ``mutate`` (optional) changes one
watched value: the traced hook's guards must then fail. Refused cases name
the expected ``TraceRefusalKind``; the offending line is marked ``# <- refused``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from loom_tracer import TraceRefusalKind

# Globals the hooks read; every case binds fresh ones with ``with_globals``.
STATS: Any = None
LOG: Any = None
COUNTS: Any = None
WEIGHTS: Any = None
KEYS: Any = None
CFG: Any = None
SEEN: Any = None
NAMES: Any = None
KEEP: Any = None
QUEUE: Any = None
HOLDER: Any = None
HELPER: Any = None
TR: Any = None
COUNTER: Any = None
LINEAR: Any = None


@dataclass
class Setup:
    hook: Callable[..., Any]
    args: tuple[Any, ...]
    state: dict[str, Any] = field(default_factory=dict)
    extra_hooks: tuple[Callable[..., Any], ...] = ()


@dataclass
class Case:
    name: str
    build: Callable[[], Setup]
    refusal: TraceRefusalKind | None = None
    mutate: Callable[[Setup], None] | None = None


CASES: list[Case] = []


def case(
    refusal: TraceRefusalKind | None = None, mutate: Callable[[Setup], None] | None = None
) -> Callable[[Callable[[], Setup]], Callable[[], Setup]]:
    def register(build: Callable[[], Setup]) -> Callable[[], Setup]:
        CASES.append(Case(build.__name__, build, refusal, mutate))
        return build

    return register


def with_globals(fn: Callable[..., Any], **names: Any) -> Any:
    """``fn`` rebound to a fresh copy of its module globals updated with ``names``."""
    assert isinstance(fn, types.FunctionType)
    namespace = dict(fn.__globals__)
    namespace.update(names)
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


def with_log(fn: Callable[..., Any]) -> Setup:
    """``fn`` with a fresh global list ``LOG``, watched."""
    log: list[Any] = []
    return Setup(with_globals(fn, LOG=log), (t43(),), {"log": log})


def t43() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g)


def set_global(name: str, value: Any) -> Callable[[Setup], None]:
    def mutate(s: Setup) -> None:
        s.hook.__globals__[name] = value

    return mutate


def set_cell(index: int, value: Any) -> Callable[[Setup], None]:
    def mutate(s: Setup) -> None:
        closure = s.hook.__closure__
        assert closure is not None
        closure[index].cell_contents = value

    return mutate


def change_arg(new_args: Callable[[], tuple[Any, ...]]) -> Callable[[Setup], None]:
    def mutate(s: Setup) -> None:
        s.args = new_args()

    return mutate


# ----------------------------------------------------------------- saved-tensor hooks

FP8_SCALE = 16.0
THRESHOLD = 8


def _pack_fp8(t):
    if t.dtype == torch.float32:
        return (t.dtype, (t * FP8_SCALE).to(torch.float8_e4m3fn))
    return (t.dtype, t)


def _unpack_fp8(packed):
    dtype, data = packed
    if data.dtype == torch.float8_e4m3fn:
        return data.to(dtype) / FP8_SCALE
    return data


@case(mutate=change_arg(lambda: (torch.ones(4, 3, dtype=torch.float64),)))
def quantize_fp8_by_dtype() -> Setup:
    return Setup(with_globals(_pack_fp8), (t43(),))


# NOTE: FP8_SCALE is a graph input (a lifted float): a new float is served, an int is not.
@case(mutate=set_global("FP8_SCALE", 8))
def dequantize_fp8() -> Setup:
    packed = (torch.float32, (t43() * 16.0).to(torch.float8_e4m3fn))
    return Setup(with_globals(_unpack_fp8), (packed,))


def _pack_by_size(t):
    if t.numel() > THRESHOLD:
        return ("bf16", t.to(torch.bfloat16))
    return ("raw", t)


@case(mutate=set_global("THRESHOLD", 100))
def quantize_bf16_by_size() -> Setup:
    return Setup(with_globals(_pack_by_size), (t43(),))


@case(mutate=change_arg(lambda: (torch.ones(2),)))
def quantize_small_tensor_passes_through() -> Setup:
    return Setup(with_globals(_pack_by_size), (torch.ones(3),))


def _offload(t):
    return (t.device, t.to("cpu", non_blocking=False))


def _reload(packed):
    device, data = packed
    return data.to(device)


@case()
def cpu_offload_pack() -> Setup:
    return Setup(with_globals(_offload), (t43(),))


@case()
def cpu_offload_unpack() -> Setup:
    return Setup(with_globals(_reload), ((torch.device("cpu"), t43()),))


def _make_counting_pack() -> Callable[..., Any]:
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t.to(torch.bfloat16)

    return pack


@case()
def counter_in_closure() -> Setup:
    hook = _make_counting_pack()
    return Setup(hook, (t43(),), {"cell": hook.__closure__})


SHAPES: list[tuple[int, ...]] = []


def _log_shapes(t):
    SHAPES.append(tuple(t.shape))
    SHAPES.append(t.dtype)
    return t * 2


@case(mutate=lambda s: s.hook.__globals__.update(SHAPES=LogList()))
def shapes_appended_to_global_list() -> Setup:
    shapes: list[Any] = [(1,)]
    return Setup(with_globals(_log_shapes, SHAPES=shapes), (t43(),), {"shapes": shapes})


def _lambda_hook(t):
    scale = 3
    f = lambda x: x * scale + 1  # noqa: E731
    return f(t)


@case()
def hook_builds_lambda_and_calls_it() -> Setup:
    return Setup(with_globals(_lambda_hook), (t43(),))


class Stats:
    def __init__(self) -> None:
        self.calls = 0
        self.last_shape: Any = None


def _record(stats, t):
    stats.last_shape = t.shape
    stats.calls = stats.calls + 1


def _hook_with_helper(t):
    _record(STATS, t)
    return t.neg()


@case(mutate=set_global("_record", lambda stats, t: None))
def helper_sets_attribute() -> Setup:
    stats = Stats()
    return Setup(with_globals(_hook_with_helper, STATS=stats), (t43(),), {"stats": stats})


class LogList(list):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__()
        self.appends = 0

    def append(self, item: Any) -> None:
        self.appends += 1
        super().append(("logged", item))


def _log_to_subclass(t):
    LOG.append(t.shape[0])
    LOG.append(t.sum())
    return t


@case(mutate=set_global("LOG", []))
def list_subclass_with_overridden_append() -> Setup:
    log = LogList()
    return Setup(with_globals(_log_to_subclass, LOG=log), (t43(),), {"log": log})


def abs(x):
    return x * 3


def _shadowed(t):
    total = abs(t)
    len = 2
    return total + len


@case(mutate=set_global("abs", lambda x: x))
def shadowed_builtin_names() -> Setup:
    return Setup(with_globals(_shadowed), (t43(),))


def _three_deep() -> Callable[..., Any]:
    a = 2

    def middle() -> Callable[..., Any]:
        b = 3

        def inner_factory() -> Callable[..., Any]:
            c = 4

            def hook(t):
                return t * a + b - c

            return hook

        return inner_factory()

    return middle()


# NOTE: the ints are graph inputs (lifted numbers): another int is served, a float is not.
@case(mutate=set_cell(0, 10.5))
def closures_three_deep() -> Setup:
    return Setup(_three_deep(), (t43(),))


def _shared_cell_pair() -> tuple[Callable[..., Any], Callable[..., Any]]:
    seen = 0

    def pack(t):
        nonlocal seen
        seen += 1
        return t + seen * 0

    def unpack(t):
        nonlocal seen
        seen -= 2
        return t

    return pack, unpack


@case()
def two_hooks_share_one_cell() -> Setup:
    pack, unpack = _shared_cell_pair()
    return Setup(pack, (t43(),), {"closure": pack.__closure__}, extra_hooks=(unpack,))


LAST: list[Any] = []


def _tensor_side_effect(t):
    LAST.append(t.abs().max())
    return t


@case()
def tensor_valued_side_effect() -> Setup:
    last: list[Any] = []
    return Setup(with_globals(_tensor_side_effect, LAST=last), (t43(),), {"last": last})


def _dict_counter(t):
    COUNTS["calls"] = COUNTS.get("calls", 0) + 1
    COUNTS[str(t.dtype)] = t.numel()
    return t


@case(mutate=lambda s: s.hook.__globals__["COUNTS"].update(other=1))
def dict_counter_global() -> Setup:
    counts: dict[str, int] = {"calls": 5}
    return Setup(with_globals(_dict_counter, COUNTS=counts), (t43(),), {"counts": counts})


def _loops(t):
    out = t
    for k in [1, 2]:
        out = out + k
    for k in (3,):
        out = out * k
    for i in range(2):
        out = out - i
    for _name, w in WEIGHTS.items():
        out = out * w
    return out


# NOTE: the weights are graph inputs (lifted floats): a new key is what is watched.
@case(mutate=lambda s: s.hook.__globals__["WEIGHTS"].update(c=9.0))
def loops_over_list_tuple_range_dict() -> Setup:
    return Setup(with_globals(_loops, WEIGHTS={"a": 0.5, "b": 2.0}), (t43(),))


def _fstring_key(t):
    KEYS[f"{t.dtype}-{tuple(t.shape)}!{t.ndim:>3}"] = t.numel()
    return t


@case(mutate=change_arg(lambda: (torch.ones(2, 2),)))
def fstring_keys() -> Setup:
    keys: dict[str, int] = {}
    return Setup(with_globals(_fstring_key, KEYS=keys), (t43(),), {"keys": keys})


def _assert_float(t):
    assert t.is_floating_point(), "need a float tensor"
    return t.half()


@case(mutate=change_arg(lambda: (torch.ones(4, 3, dtype=torch.int64),)))
def assert_on_dtype_becomes_guard() -> Setup:
    return Setup(with_globals(_assert_float), (t43(),))


def _raise_for_ints(t):
    if t.dtype in (torch.int32, torch.int64):
        raise TypeError("integer tensors are not packed")
    return t.float()


@case(mutate=change_arg(lambda: (torch.ones(4, 3, dtype=torch.int32),)))
def raise_constant_error_becomes_guard() -> Setup:
    return Setup(with_globals(_raise_for_ints), (t43(),))


def _no_grad(t):
    with torch.no_grad():
        y = t * 2
    return y + 1


@case()
def with_no_grad() -> Setup:
    return Setup(with_globals(_no_grad), (t43().requires_grad_(),))


def _scaled(x, *extra, scale=1.0, **named):
    out = x * scale
    for e in extra:
        out = out + e
    return out + named.get("bias", 0)


def _kwargs_hook(t):
    args = (1, 2)
    return _scaled(t, *args, scale=2.0, bias=0.5)


@case()
def keyword_and_star_arguments() -> Setup:
    return Setup(with_globals(_kwargs_hook), (t43(),))


def _nested_def(t):
    k = 3

    def add_k(x, m=2):
        return x * m + k

    return add_k(t), add_k(t, m=5)


@case()
def nested_function_with_own_closure() -> Setup:
    return Setup(with_globals(_nested_def), (t43(),))


def _builtins(t):
    dims = len(t.shape)
    biggest = max(t.shape)
    smallest = min(3, biggest)
    ok = isinstance(t, torch.Tensor) and getattr(t, "dtype", None) is torch.float32
    pairs = list(zip(range(dims), t.shape, strict=True))
    total = sum(i * s for i, s in enumerate(t.shape))
    return t * (dims + biggest + smallest + total + len(pairs)) if ok else t


@case(mutate=change_arg(lambda: (torch.ones(5, 3),)))
def builtins_len_max_min_isinstance_getattr_zip_enumerate() -> Setup:
    return Setup(with_globals(_builtins), (t43(),))


def _containers(t):
    a, *rest = [t, t * 2, t * 3]
    d = {"x": a, **{"y": rest[0]}}
    s = {1, 2}
    (p, q), r = (d["x"], d["y"]), rest[-1]
    return p + q + r * len(s)


@case()
def build_and_unpack_containers() -> Setup:
    return Setup(with_globals(_containers), (t43(),))


def _rg_branch(t):
    if t.requires_grad:
        return t.detach() * 2
    return t * 3


@case(mutate=change_arg(lambda: (t43(),)))
def branch_on_requires_grad() -> Setup:
    return Setup(with_globals(_rg_branch), (t43().requires_grad_(),))


def _device_branch(t):
    if t.device.type == "cpu":
        return t + 1
    return t.to("cpu")


@case(mutate=change_arg(lambda: (torch.ones(4, 3, device="meta"),)))
def branch_on_device() -> Setup:
    return Setup(with_globals(_device_branch), (t43(),))


ENABLED = True


def _flag(t):
    if ENABLED:
        return t.sigmoid()
    return t


@case(mutate=set_global("ENABLED", False))
def global_flag_selects_path() -> Setup:
    return Setup(with_globals(_flag), (t43(),))


def _closure_scale() -> Callable[..., Any]:
    scale = 0.25

    def pack(t):
        return t * scale

    return pack


# NOTE: a float scale is a graph input (lifted): its type is guarded, not its value.
@case(mutate=set_cell(0, 1))
def closure_float_scale_is_a_graph_input() -> Setup:
    return Setup(_closure_scale(), (t43(),))


class Config:
    def __init__(self) -> None:
        self.bits = 8
        self.mode = "fp8"


def _config_hook(t):
    if CFG.mode == "fp8" and CFG.bits == 8:
        return t.to(torch.float8_e5m2)
    return t


@case(mutate=lambda s: setattr(s.hook.__globals__["CFG"], "bits", 4))
def attribute_of_config_object() -> Setup:
    return Setup(with_globals(_config_hook, CFG=Config()), (t43(),))


def _comprehensions(t):
    sizes = [s * 2 for s in t.shape if s > 1]
    named = {f"d{i}": s for i, s in enumerate(t.shape)}
    return t.reshape(sizes[0] // 2, -1) * named["d1"]


@case()
def list_and_dict_comprehensions() -> Setup:
    return Setup(with_globals(_comprehensions), (t43(),))


def _seen_dtypes(t):
    if t.dtype not in SEEN:
        SEEN.add(t.dtype)
    return t


@case(mutate=lambda s: s.hook.__globals__["SEEN"].add(torch.float32))
def set_of_seen_dtypes() -> Setup:
    seen: set[Any] = {torch.int8}
    return Setup(with_globals(_seen_dtypes, SEEN=seen), (t43(),), {"seen": seen})


def _indexing(t):
    return t[..., :2], t[0], t[1:3, None], t[-1, 1:]


@case()
def tensor_indexing_and_slicing() -> Setup:
    return Setup(with_globals(_indexing), (t43(),))


def _functional(t):
    return F.relu(t) + F.softmax(t, dim=-1) + torch.nn.functional.gelu(t)


@case()
def torch_nn_functional_calls() -> Setup:
    return Setup(with_globals(_functional), (t43(),))


def _cat_stack(t):
    parts = [t, t + 1]
    return torch.cat(parts, dim=0), torch.stack((t, t), 1)


@case()
def cat_and_stack_of_lists() -> Setup:
    return Setup(with_globals(_cat_stack), (t43(),))


def _chunks(t):
    a, b = t.chunk(2, dim=0)
    rows = t.unbind(0)
    return a * b, rows[0] + rows[-1]


@case()
def chunk_and_unbind_tuples() -> Setup:
    return Setup(with_globals(_chunks), (t43(),))


def _method_kwargs(t):
    return t.sum(dim=0, keepdim=True).expand(4, 3).contiguous().view(-1)


@case()
def method_chain_with_keywords() -> Setup:
    return Setup(with_globals(_method_kwargs), (t43(),))


def _inplace_intermediate(t):
    y = t.clone()
    y.mul_(2)
    y += 1
    y[0] = 0.0
    return y


@case()
def inplace_ops_on_intermediates() -> Setup:
    return Setup(with_globals(_inplace_intermediate), (t43(),))


N_CALLS = 0


def _global_counter(t):
    global N_CALLS
    N_CALLS += 1
    return t


@case()
def global_counter_statement() -> Setup:
    hook = with_globals(_global_counter, N_CALLS=3)
    return Setup(hook, (t43(),), {"globals": _Globals(hook.__globals__, "N_CALLS")})


@dataclass
class _Globals:
    """Compares one name of a globals dict."""

    namespace: dict[str, Any]
    name: str

    def value(self) -> Any:
        return self.namespace.get(self.name)


def _defaults(t, factor=2, log=[]):  # noqa: B006  (a mutable default on purpose)
    log.append(factor)
    return t * factor


@case()
def default_arguments_and_mutable_default() -> Setup:
    hook = with_globals(_defaults)
    hook.__defaults__ = (2, [])
    return Setup(hook, (t43(),), {"defaults": hook.__defaults__})


def _square(x):
    return x * x


def _helper_twice(t):
    return _square(_square(t) + 1)


@case()
def helper_inlined_twice() -> Setup:
    return Setup(with_globals(_helper_twice), (t43(),))


def _strings(t):
    name = "Packed".upper() + "-" + ", ".join(str(s) for s in [1, 2])
    NAMES.append(name)
    return t


@case()
def string_methods_and_generator_expression_join() -> Setup:
    names: list[str] = []
    return Setup(with_globals(_strings, NAMES=names), (t43(),), {"names": names})


def _shape_info(t):
    n, m = t.shape
    return {"rows": n, "cols": m, "data": t.t()}


@case()
def returns_dict_with_shape_info() -> Setup:
    return Setup(with_globals(_shape_info), (t43(),))


def _input_stored(t):
    KEEP.append(t)
    KEEP.append([t.shape, [t.ndim]])
    return t


@case()
def input_tensor_stored_in_list_keeps_identity() -> Setup:
    keep: list[Any] = []
    return Setup(with_globals(_input_stored, KEEP=keep), (t43(),), {"keep": keep})


def _pop_and_clear(t):
    if len(QUEUE) > 2:
        QUEUE.pop(0)
    QUEUE.insert(0, t.numel())
    return t


@case(mutate=lambda s: s.hook.__globals__["QUEUE"].pop())
def list_pop_insert_with_len_guard() -> Setup:
    q = [1, 2, 3]
    return Setup(with_globals(_pop_and_clear, QUEUE=q), (t43(),), {"q": q})


def _where(t):
    return torch.where(t > 0, t, torch.zeros_like(t))


@case()
def torch_where_instead_of_branch() -> Setup:
    return Setup(with_globals(_where), (t43(),))


def _finfo(t):
    amax = torch.finfo(torch.float8_e4m3fn).max
    return (t.clamp(-amax, amax) / amax).to(torch.float8_e4m3fn)


@case()
def finfo_constant_fp8_scaling() -> Setup:
    return Setup(with_globals(_finfo), (t43(),))


# ------------------------------------------------------------------ more hook shapes


def h_nested_nonlocal(t):
    total = 0

    def add(x):
        nonlocal total
        total += x

    for s in t.shape:
        add(s)
    return t * total


def _make_helper():
    calls = 0

    def helper(x):
        nonlocal calls
        calls += 1
        return x + calls

    return helper


def h_preexisting_closure_helper(t):
    return HELPER(t)


class Tracker:
    def __init__(self):
        self.hist = []

    def record(self, x):
        self.hist.append(x)
        return len(self.hist)


def h_method(t):
    n = TR.record(t.shape[0])
    return t * n


def h_while(t):
    i = 0
    out = t
    while i < 3:
        out = out + i
        i += 1
    return out


def h_ternary_chain(t):
    n = t.shape[0]
    k = 2 if 0 < n < 10 else 3
    flag = (n > 1 and t.ndim == 2) or False
    return t * k if flag else t


def h_try_finally(t):
    try:
        y = t * 2
    finally:
        LOG.append("done")
    return y


def h_view_star(t):
    shape = t.shape
    return t.reshape(*shape[::-1]), t.size(-1), t.view(-1, shape[-1])


def h_return_preexisting(t):
    LOG.append(t.shape)
    return LOG


def h_del_walrus(t):
    x = t + 1
    del x
    if (n := t.numel()) > 3:
        return t * n
    return t


def h_percent(t):
    LOG.append("%s:%d" % (t.dtype, t.numel()))  # noqa: UP031  (percent format on purpose)
    return t


def h_lambda_defaults(t):
    fs = [lambda x, k=k: x * k for k in range(3)]
    return sum(f(t) for f in fs)


def h_isinstance_list(t):
    xs = [t, t]
    if isinstance(xs, (list, tuple)) and not isinstance(xs, dict):
        return torch.stack(xs)
    return t


def h_unpack_dict(packed):
    return packed["data"].to(packed["dtype"]) * packed["scale"]


def h_sorted_keys(t):
    d = {"b": 2, "a": 1}
    out = t
    for k in sorted(d):
        out = out * d[k]
    return out


def h_max_shape_kw(t):
    return t.amax(dim=tuple(range(t.ndim))), t.shape.numel(), t.flatten().shape


def h_global_rebind(t):
    global COUNTER
    COUNTER = COUNTER + t.ndim
    return t


def h_cell_then_read(t):
    x = 1

    def read():
        return x

    x = 5
    return t * read()


def h_structseq(t):
    values, indices = torch.max(t, 0)
    r = torch.max(t, 1)
    return values + r.values.sum(), indices, r.indices


@case()
def more_structseq_return_types() -> Setup:
    return Setup(with_globals(h_structseq), (t43(),))


@case()
def more_nested_nonlocal() -> Setup:
    return Setup(with_globals(h_nested_nonlocal), (t43(),))


@case(mutate=set_global("HELPER", lambda x: x))
def more_preexisting_closure_helper() -> Setup:
    helper = _make_helper()
    hook = with_globals(h_preexisting_closure_helper, HELPER=helper)
    return Setup(hook, (t43(),), {"cells": helper.__closure__})


@case(mutate=lambda s: setattr(s.hook.__globals__["TR"], "record", lambda x: 1))
def more_method() -> Setup:
    tracker = Tracker()
    return Setup(with_globals(h_method, TR=tracker), (t43(),), {"tracker": tracker})


@case()
def more_while() -> Setup:
    return Setup(with_globals(h_while), (t43(),))


@case()
def more_ternary_chain() -> Setup:
    return Setup(with_globals(h_ternary_chain), (t43(),))


@case()
def more_try_finally() -> Setup:
    return with_log(h_try_finally)


@case()
def more_view_star() -> Setup:
    return Setup(with_globals(h_view_star), (t43(),))


@case()
def more_return_preexisting() -> Setup:
    return with_log(h_return_preexisting)


@case()
def more_del_walrus() -> Setup:
    return Setup(with_globals(h_del_walrus), (t43(),))


@case()
def more_percent() -> Setup:
    return with_log(h_percent)


@case()
def more_lambda_defaults() -> Setup:
    return Setup(with_globals(h_lambda_defaults), (t43(),))


@case()
def more_isinstance_list() -> Setup:
    return Setup(with_globals(h_isinstance_list), (t43(),))


@case(mutate=lambda s: s.args[0].update(dtype=torch.float64))
def more_unpack_dict() -> Setup:
    return Setup(
        with_globals(h_unpack_dict),
        ({"data": t43().bfloat16(), "dtype": torch.float32, "scale": 0.5},),
    )


@case(mutate=set_global("sorted", reversed))
def more_sorted_keys() -> Setup:
    return Setup(with_globals(h_sorted_keys), (t43(),))


@case()
def more_max_shape_kw() -> Setup:
    return Setup(with_globals(h_max_shape_kw), (t43(),))


@case()
def more_global_rebind() -> Setup:
    hook = with_globals(h_global_rebind, COUNTER=1)
    return Setup(hook, (t43(),), {"globals": _Globals(hook.__globals__, "COUNTER")})


@case(mutate=change_arg(lambda: (t43().double(),)))
def more_cell_then_read() -> Setup:
    return Setup(with_globals(h_cell_then_read), (t43(),))


def _closure_tensor() -> Callable[..., Any]:
    scale = torch.full((3,), 0.5)

    def pack(t):
        return t * scale

    return pack


@case(mutate=set_cell(0, torch.full((4,), 0.5)))
def tensor_in_closure_is_a_lifted_graph_input() -> Setup:
    return Setup(_closure_tensor(), (t43(),))


def h_shared_new_row(t):
    row = [t.shape[0]]
    LOG.append(row)
    LOG.append(row)
    row.append(t.ndim)
    return t


@case()
def new_list_stored_twice_keeps_identity() -> Setup:
    return with_log(h_shared_new_row)


# ------------------------------------------------------------ closure cells (loom_cells)


def h_new_cell_shared_by_two_nested(t):
    total = 0

    def add(x):
        nonlocal total
        total += x

    def scaled(u):
        return u * total

    for s in t.shape:
        add(s)
    first = scaled(t)
    add(1)
    return first, scaled(t)


@case()
def cells_new_cell_shared_by_two_nested_functions() -> Setup:
    return Setup(with_globals(h_new_cell_shared_by_two_nested), (t43(),))


def _make_shadowing() -> Callable[..., Any]:
    x = 2

    def hook(t):
        nonlocal x

        def shadow_local():
            x = 100  # a local of this function: the outer cell is untouched
            return x

        def shadow_cell():
            x = 5  # this function's own cell, shared with g only

            def g():
                nonlocal x
                x += 1
                return x

            return g()

        def reads_outer():
            return x

        x = x + shadow_local() + shadow_cell()
        return t * reads_outer()

    return hook


@case(mutate=set_cell(0, 3.5))
def cells_nested_locals_and_cells_shadow_the_outer_cell() -> Setup:
    hook = _make_shadowing()
    return Setup(hook, (t43(),), {"cells": hook.__closure__})


def _make_hook_and_helper_sharing_a_cell() -> Callable[..., Any]:
    n = 1

    def bump():
        nonlocal n
        n += 1

    def hook(t):
        before = n
        bump()
        return t * before, t * n

    return hook


@case(mutate=set_cell(1, 10.5))
def cells_hook_and_helper_share_a_preexisting_cell() -> Setup:
    hook = _make_hook_and_helper_sharing_a_cell()
    return Setup(hook, (t43(),), {"cells": hook.__closure__})


def h_argument_in_cell(t):
    def twice():
        return t * 2

    def bump():
        nonlocal t
        t = t + 1

    bump()
    return twice() + t


@case()
def cells_argument_captured_and_rebound_by_nested_functions() -> Setup:
    return Setup(with_globals(h_argument_in_cell), (t43(),))


def h_comprehension_cells(t):
    k = 10
    fs = [lambda: k for k in range(3)]  # noqa: B023  (late binding on purpose: all see 2)
    return t * (sum([f() for f in fs]) + k)


@case()
def cells_comprehension_makes_its_own_cell_beside_an_outer_local() -> Setup:
    return Setup(with_globals(h_comprehension_cells), (t43(),))


def h_comprehension_shadows_outer_cell(t):
    k = 10
    get_k = lambda: k  # noqa: E731
    fs = [lambda: k for k in range(3)]  # noqa: B023
    return t * (sum([f() for f in fs]) + get_k() + k)


@case()
def cells_comprehension_cell_shadows_an_outer_cell() -> Setup:
    return Setup(with_globals(h_comprehension_shadows_outer_cell), (t43(),))


# ------------------------------------------------------------------ refused hooks


def _tensor_branch(t):
    if t.sum() > 0:  # <- refused
        return t
    return -t


@case(refusal=TraceRefusalKind.TENSOR_VALUE_CONTROL_FLOW)
def refuses_branch_on_tensor_value() -> Setup:
    return Setup(with_globals(_tensor_branch), (t43(),))


def _item(t):
    v = t.max().item()  # <- refused
    return t / v


@case(refusal=TraceRefusalKind.DATA_DEPENDENT_OP)
def refuses_item() -> Setup:
    return Setup(with_globals(_item), (t43(),))


def _print(t):
    print(t.shape)  # <- refused
    return t


@case(refusal=TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT)
def refuses_print() -> Setup:
    return Setup(with_globals(_print), (t43(),))


def _mutate_input(t):
    t.mul_(2)  # <- refused
    return t


@case(refusal=TraceRefusalKind.INPUT_MUTATION)
def refuses_inplace_on_input() -> Setup:
    return Setup(with_globals(_mutate_input), (t43(),))


def _always_raises(t):
    if t.dim() == 2:
        raise ValueError("2-d tensors are not supported")  # <- refused
    return t


@case(refusal=TraceRefusalKind.HOOK_RAISES)
def refuses_hook_that_raises_for_these_inputs() -> Setup:
    return Setup(with_globals(_always_raises), (t43(),))


def _recurse(x, n):
    if n == 0:
        return x
    return _recurse(x + 1, n - 1)  # <- refused


def _recursive_hook(t):
    return _recurse(t, 100)


@case(refusal=TraceRefusalKind.INLINE_DEPTH)
def refuses_deep_recursion() -> Setup:
    return Setup(with_globals(_recursive_hook), (t43(),))


def _escaping(t):
    HOLDER.append(lambda: t)  # <- refused
    return t


@case(refusal=TraceRefusalKind.ESCAPING_FUNCTION)
def refuses_function_escaping_into_state() -> Setup:
    return Setup(with_globals(_escaping, HOLDER=[]), (t43(),))


def _closure_escapes(t):
    scale = t.shape[0]

    def rescale(u):
        return u * scale

    HOLDER.append(rescale)  # <- refused
    return t


@case(refusal=TraceRefusalKind.ESCAPING_FUNCTION)
def refuses_closure_over_a_new_cell_escaping_into_a_global_list() -> Setup:
    return Setup(with_globals(_closure_escapes, HOLDER=[]), (t43(),))


def _make_callback_holder() -> Callable[..., Any]:
    callback = None

    def hook(t):
        nonlocal callback
        k = t.ndim
        callback = lambda u: u * k  # <- refused  # noqa: E731
        return t

    return hook


@case(refusal=TraceRefusalKind.ESCAPING_FUNCTION)
def refuses_closure_over_a_new_cell_stored_into_a_preexisting_cell() -> Setup:
    hook = _make_callback_holder()
    return Setup(hook, (t43(),), {"cells": hook.__closure__})


def _new_object(t):
    _s = Stats()  # <- refused
    return t


@case(refusal=TraceRefusalKind.UNSUPPORTED_CALL)
def refuses_creating_user_objects() -> Setup:
    return Setup(with_globals(_new_object), (t43(),))


def _import_inside(t):
    import math  # <- refused

    return t * math.pi


@case(refusal=TraceRefusalKind.UNSUPPORTED_OPCODE)
def refuses_import_statement() -> Setup:
    return Setup(with_globals(_import_inside), (t43(),))


def _nonzero(t):
    return t.nonzero()  # <- refused


@case(refusal=TraceRefusalKind.DATA_DEPENDENT_OP)
def refuses_data_dependent_shape() -> Setup:
    return Setup(with_globals(_nonzero), (t43(),))


def _module_global(t):
    return LINEAR(t)  # <- refused


@case(refusal=TraceRefusalKind.UNSUPPORTED_VALUE)
def refuses_nn_module_in_hook() -> Setup:
    return Setup(with_globals(_module_global, LINEAR=torch.nn.Linear(3, 3)), (t43(),))


def _grad_attr(t):
    return t.grad  # <- refused


@case(refusal=TraceRefusalKind.UNSUPPORTED_ATTRIBUTE)
def refuses_tensor_grad_attribute() -> Setup:
    return Setup(with_globals(_grad_attr), (t43(),))


def _shape_error(t):
    return t + torch.ones(5)  # <- refused


@case(refusal=TraceRefusalKind.TORCH_ERROR)
def refuses_torch_error_on_fake_tensors() -> Setup:
    return Setup(with_globals(_shape_error), (t43(),))


def _gen_helper(t):
    yield t


def _uses_generator(t):
    return list(_gen_helper(t))  # <- refused


@case(refusal=TraceRefusalKind.UNSUPPORTED_CALL)
def refuses_generators() -> Setup:
    return Setup(with_globals(_uses_generator), (t43(),))


def _try_except(t):
    with open("/dev/null") as f:  # <- refused
        f.read()
    return t


@case(refusal=TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT)
def refuses_open_and_other_io() -> Setup:
    return Setup(with_globals(_try_except), (t43(),))
