"""Handlers: branches, loops, returns, raise/assert and ``with torch.no_grad()``.

Every branch is decided at trace time: its condition is a constant, or a value
whose sources get guards; a branch on tensor data is refused. A ``raise`` that
the trace reaches (including a failing ``assert``) refuses the hook, since the
hook would raise for these inputs; the branches that avoid it are guarded.
"""

from __future__ import annotations

import dis

from ._containers import iterate
from ._frame import Frame, handles
from ._operators import is_same, truthy
from ._pyversion import (
    COMMON_CONSTANTS,
    END_FOR_POPS_ITERATOR,
    FOR_ITER_EXITS_THROUGH_END_FOR,
    NEW_LOADS_AND_HINTS,
    PY311,
    PY312,
    RETURN_CONST_REMOVED,
    WITH_LOADS_SPECIAL_METHODS,
)
from ._refusal import TraceRefusalKind, refuse
from ._streams import enter_stream_context
from ._values import (
    NULL,
    ConstV,
    GradEnterV,
    GradExitV,
    GradModeV,
    IteratorV,
    NoOpCallV,
    StreamContextV,
    Value,
)

_NONE = ConstV(None)


def _jump_if(frame: Frame, inst: dis.Instruction, condition: bool) -> None:
    if condition:
        frame.jump(inst.argval)


@handles("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")
def _jump(frame: Frame, inst: dis.Instruction) -> None:
    frame.jump(inst.argval)


@handles("POP_JUMP_IF_TRUE", when=PY312)
@handles("POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE", when=PY311)
def _pop_jump_if_true(frame: Frame, inst: dis.Instruction) -> None:
    _jump_if(frame, inst, truthy(frame.ctx, frame.pop()))


@handles("POP_JUMP_IF_FALSE", when=PY312)
@handles("POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE", when=PY311)
def _pop_jump_if_false(frame: Frame, inst: dis.Instruction) -> None:
    _jump_if(frame, inst, not truthy(frame.ctx, frame.pop()))


@handles("POP_JUMP_IF_NONE", when=PY312)
@handles("POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NONE", when=PY311)
def _pop_jump_if_none(frame: Frame, inst: dis.Instruction) -> None:
    _jump_if(frame, inst, is_same(frame.ctx, frame.pop(), _NONE))


@handles("POP_JUMP_IF_NOT_NONE", when=PY312)
@handles("POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE", when=PY311)
def _pop_jump_if_not_none(frame: Frame, inst: dis.Instruction) -> None:
    _jump_if(frame, inst, not is_same(frame.ctx, frame.pop(), _NONE))


@handles("JUMP_IF_TRUE_OR_POP", when=PY311)
def _jump_if_true_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    if truthy(frame.ctx, frame.stack[-1]):
        frame.jump(inst.argval)
    else:
        frame.pop()


@handles("JUMP_IF_FALSE_OR_POP", when=PY311)
def _jump_if_false_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    if not truthy(frame.ctx, frame.stack[-1]):
        frame.jump(inst.argval)
    else:
        frame.pop()


@handles("GET_ITER")
def _get_iter(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(iterate(frame.ctx, frame.pop()))


@handles("FOR_ITER")
def _for_iter(frame: Frame, inst: dis.Instruction) -> None:
    it = frame.stack[-1]
    assert isinstance(it, IteratorV)
    if it.pos < len(it.items):
        it.pos += 1
        frame.push(it.items[it.pos - 1])
        return
    if FOR_ITER_EXITS_THROUGH_END_FOR:
        frame.push(_NONE)  # what END_FOR pops in place of a value
    else:
        frame.pop()
    frame.jump(inst.argval)


@handles("END_FOR", when=PY312)
def _end_for(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()
    if END_FOR_POPS_ITERATOR:
        frame.pop()


@handles("POP_ITER", when=NEW_LOADS_AND_HINTS)
def _pop_iter(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()


@handles("NOT_TAKEN", when=NEW_LOADS_AND_HINTS)
def _not_taken(frame: Frame, inst: dis.Instruction) -> None:
    """3.14: a hint for branch monitoring; nothing happens."""


@handles("RETURN_VALUE")
def _return_value(frame: Frame, inst: dis.Instruction) -> None:
    frame.result = frame.pop()


@handles("RETURN_CONST", when=PY312 and not RETURN_CONST_REMOVED)
def _return_const(frame: Frame, inst: dis.Instruction) -> None:
    frame.result = ConstV(inst.argval)


@handles("LOAD_ASSERTION_ERROR", when=not COMMON_CONSTANTS)
def _load_assertion_error(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ConstV(AssertionError))


# CPython's common constants (Python/pylifecycle.c, 3.14), by LOAD_COMMON_CONSTANT's oparg.
_COMMON_CONSTANTS: tuple[object, ...] = (AssertionError, NotImplementedError, tuple, all, any)


@handles("LOAD_COMMON_CONSTANT", when=COMMON_CONSTANTS)
def _load_common_constant(frame: Frame, inst: dis.Instruction) -> None:
    assert inst.arg is not None
    frame.push(ConstV(_COMMON_CONSTANTS[inst.arg]))


@handles("RAISE_VARARGS")
def _raise_varargs(frame: Frame, inst: dis.Instruction) -> None:
    values: list[Value] = frame.popn(inst.arg or 0)
    what = "re-raise"
    if values:
        exc = values[0]
        what = repr(exc.value) if isinstance(exc, ConstV) else f"a {exc.py_type.__qualname__}"
    raise refuse(
        TraceRefusalKind.HOOK_RAISES,
        f"the hook raises {what} for these inputs",
        "the trace only covers inputs for which the hook returns normally",
    )


def _context_manager(frame: Frame, manager: Value) -> GradModeV | StreamContextV:
    """The context manager a ``with`` enters: a grad mode, or a stream context (which the
    trace records and otherwise ignores, ``_streams``)."""
    if isinstance(manager, GradModeV):
        return manager
    stream_context = enter_stream_context(frame.ctx, manager)
    if stream_context is None:
        raise refuse(
            TraceRefusalKind.UNSUPPORTED_CALL,
            f"with-statement over a {manager.py_type.__qualname__}",
            "only `with torch.no_grad()`, `with torch.enable_grad()` and stream contexts "
            "(`with torch.cuda.stream(s)`) are supported",
        )
    return stream_context


# NOTE: 3.11 to 3.13 enter a `with` the same way (BEFORE_WITH, and a CALL of __exit__
# with three Nones on the normal path; WITH_EXCEPT_START is only reached by an exception,
# which the trace never follows): one handler, no flag. 3.14 loads the methods instead.
@handles("BEFORE_WITH", when=not WITH_LOADS_SPECIAL_METHODS)
def _before_with(frame: Frame, inst: dis.Instruction) -> None:
    manager = _context_manager(frame, frame.pop())
    if isinstance(manager, StreamContextV):
        frame.push(NoOpCallV(_NONE))
        frame.push(manager.entered)
        return
    frame.push(GradExitV(frame.ctx.grad_enabled))
    frame.ctx.grad_enabled = manager.enabled
    frame.push(_NONE)


# CPython's special methods (Python/ceval.c, 3.14), by LOAD_SPECIAL's oparg.
_ENTER, _EXIT = 0, 1


@handles("LOAD_SPECIAL", when=WITH_LOADS_SPECIAL_METHODS)
def _load_special(frame: Frame, inst: dis.Instruction) -> None:
    """3.14: ``__exit__`` is loaded before ``__enter__`` is called, so it captures the
    grad mode to restore; the NULL follows the bound method (as Dynamo models it)."""
    manager = frame.pop()
    if inst.arg == _EXIT:
        if isinstance(manager, GradModeV):
            frame.push(GradExitV(frame.ctx.grad_enabled))
        else:
            frame.push(NoOpCallV(_NONE))
    elif inst.arg == _ENTER:
        entered = _context_manager(frame, manager)
        if isinstance(entered, StreamContextV):
            frame.push(NoOpCallV(entered.entered))
        else:
            frame.push(GradEnterV(entered.enabled))
    else:
        raise refuse(TraceRefusalKind.UNSUPPORTED_OPCODE, f"LOAD_SPECIAL {inst.argrepr}")
    frame.push(NULL)


@handles("RETURN_GENERATOR")
def _return_generator(frame: Frame, inst: dis.Instruction) -> None:
    if frame.yields is None:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "generators are not supported")
    frame.push(_NONE)


@handles("YIELD_VALUE")
def _yield_value(frame: Frame, inst: dis.Instruction) -> None:
    if frame.yields is None:
        raise refuse(TraceRefusalKind.UNSUPPORTED_CALL, "generators are not supported")
    frame.yields.append(frame.pop())
    frame.push(_NONE)
