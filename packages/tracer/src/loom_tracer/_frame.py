"""Frames and the opcode-handler registry: the symbolic stack machine.

A ``Frame`` interprets one code object over ``Value``s: an instruction list
from ``dis``, a value stack, fast locals, its cells by name (a
``loom_cells.FrameCells``: free variables bound to the function's closure,
cell variables made by ``MAKE_CELL``), and the globals of the function.
Handlers register with ``@handles("OPNAME", when=FLAG)``; registration skips
(and records in ``UNAVAILABLE``) an opcode this Python lacks, refuses one
registered twice, and an opcode without a handler refuses the hook with its
file:line.
"""

from __future__ import annotations

import dis
import inspect
import os
import types
from collections.abc import Callable

from loom_cells import CellRefused, FrameCells
from loom_sidefx import ObjectSource

from ._context import TraceContext, cell_refusal
from ._refusal import Refused, TraceRefusalKind, refuse
from ._values import FunctionV, IteratorV, TupleV, Value

Handler = Callable[["Frame", dis.Instruction], None]
HANDLERS: dict[str, Handler] = {}
#: Opcodes a handler was declared for (its ``when`` flag holds) that this Python's
#: ``dis`` does not have. Empty on every Python the tracer knows (a test checks it);
#: on a newer one the handler is skipped, so importing never fails there.
UNAVAILABLE: list[str] = []


def handles(*opnames: str, when: bool = True) -> Callable[[Handler], Handler]:
    """Register a handler for ``opnames`` (only when ``when``, a ``_pyversion`` flag, holds)."""

    def register(fn: Handler) -> Handler:
        if not when:
            return fn
        for name in opnames:
            if name not in dis.opmap:
                UNAVAILABLE.append(name)
                continue
            if name in HANDLERS:
                raise ValueError(f"@handles({name!r}): registered twice")
            HANDLERS[name] = fn
        return fn

    return register


class Frame:
    """One activation of a code object being traced."""

    def __init__(
        self, ctx: TraceContext, fn: FunctionV, bound: dict[str, Value], depth: int
    ) -> None:
        self.ctx = ctx
        self.fn = fn
        self.code = fn.code
        self.globals = fn.globals
        self.depth = depth
        self.instructions = list(dis.get_instructions(self.code))
        self.index_of = {inst.offset: i for i, inst in enumerate(self.instructions)}
        self.stack: list[Value] = []
        self.locals: dict[str, Value] = dict(bound)
        self.kw_names: tuple[str, ...] = ()
        self.ip = 0
        self.result: Value | None = None
        self.yields: list[Value] | None = None
        self.lineno = self.code.co_firstlineno
        self.filename = os.path.basename(self.code.co_filename)
        # NOTE: cell variables are made by the MAKE_CELL handler, as CPython does.
        self.cell_names = frozenset(self.code.co_cellvars + self.code.co_freevars)
        try:
            self.cells = FrameCells(ctx.cells, self.code, fn.closure)
        except CellRefused as exc:
            raise cell_refusal(exc) from None
        ctx.codes.append(self.code)

    @property
    def where(self) -> str:
        return f"{self.filename}:{self.lineno}"

    # ------------------------------------------------------------ stack helpers
    def push(self, v: Value) -> None:
        self.stack.append(v)

    def pop(self) -> Value:
        return self.stack.pop()

    def popn(self, n: int) -> list[Value]:
        if n == 0:
            return []
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def jump(self, offset: int) -> None:
        self.ip = self.index_of[offset]

    # ------------------------------------------------------------------- run
    def run(self) -> Value:
        try:
            while self.result is None:
                inst = self.instructions[self.ip]
                self.ip += 1
                line = inst.positions.lineno if inst.positions is not None else None
                if line is not None and line != self.lineno:
                    self.lineno = line
                    self.ctx.where = self.where
                handler = HANDLERS.get(inst.opname)
                if handler is None:
                    raise refuse(
                        TraceRefusalKind.UNSUPPORTED_OPCODE,
                        f"opcode {inst.opname} is not supported by the hook tracer",
                        "rewrite this line with simpler Python (see docs/tracer.md for the supported subset)",
                    )
                handler(self, inst)
        except CellRefused as exc:
            refused = cell_refusal(exc)
            refused.where = self.where
            raise refused from None
        except Refused as exc:
            if exc.where is None:
                exc.where = self.where
            raise
        self.ctx.where = self.where
        return self.result


class _Default:
    def __init__(self, index: int | str) -> None:
        self.index = index


def inline_call(
    ctx: TraceContext, fn: FunctionV, args: list[Value], kwargs: dict[str, Value], depth: int
) -> Value:
    """Trace a call of a Python function by interpreting its bytecode in a new frame."""
    if depth >= ctx.max_depth:
        raise refuse(
            TraceRefusalKind.INLINE_DEPTH,
            f"calls nest deeper than {ctx.max_depth} levels (at {fn.name})",
            "recursion is not supported; flatten the helper calls",
        )
    flags = fn.code.co_flags
    genexpr = bool(flags & inspect.CO_GENERATOR) and fn.code.co_name == "<genexpr>"
    if (
        flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR)
        and not genexpr
    ):
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL,
            f"{fn.name} is a generator or coroutine",
            "return a list instead (generator expressions are supported)",
        )
    # Bind like CPython does, on a stand-in function whose defaults are markers.
    n_defaults = len(fn.fn.__defaults__ or ()) if fn.fn is not None else len(fn.defaults)
    kw_names = (
        list(getattr(fn.fn, "__kwdefaults__", None) or {})
        if fn.fn is not None
        else list(fn.kwdefaults)
    )
    stand_in = types.FunctionType(
        fn.code,
        {},
        fn.name,
        tuple(_Default(i) for i in range(n_defaults)) or None,
        tuple(types.CellType() for _ in fn.code.co_freevars) or None,
    )
    stand_in.__kwdefaults__ = {k: _Default(k) for k in kw_names} or None
    try:
        bound_args = inspect.signature(stand_in).bind(*args, **kwargs)
    except TypeError as exc:
        raise refuse(TraceRefusalKind.HOOK_RAISES, f"calling {fn.name}: {exc}") from None
    bound_args.apply_defaults()
    bound: dict[str, Value] = {}
    # inspect renames implicit parameters (".0" of comprehensions); the code's names are real.
    varnames = set(fn.code.co_varnames)
    for name, value in bound_args.arguments.items():
        param = bound_args.signature.parameters[name]
        if name not in varnames and name.startswith("implicit"):
            name = "." + name[len("implicit") :]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            bound[name] = TupleV(tuple(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            bound[name] = ctx.new_dict(value.items())
        elif isinstance(value, _Default):
            bound[name] = ctx.default_value(fn, value.index)
        else:
            bound[name] = value
    frame = Frame(ctx, fn, bound, depth + 1)
    if not genexpr:
        return frame.run()
    # NOTE: a generator expression is run to completion when created; that is
    # exact as long as producing its items has no side effects, checked here.
    frame.yields = []
    effects_before = ctx.side_effects.num_ops
    frame.run()
    if ctx.side_effects.num_ops != effects_before:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_SIDE_EFFECT,
            "a generator expression with side effects",
            "use a list comprehension or a for loop",
        )
    return IteratorV(frame.yields)


def make_root_function(fn: types.FunctionType, ctx: TraceContext) -> FunctionV:
    """The hook itself, with its closure cells (sourced ``closure[i:name]``) and defaults
    modelled as pre-existing state."""
    source = ObjectSource(fn, f"hook {fn.__module__}.{fn.__qualname__}")
    closure = ctx.cells.hook_closure(fn)
    return FunctionV(fn.__code__, fn.__globals__, fn.__name__, closure, (), {}, fn, source)
