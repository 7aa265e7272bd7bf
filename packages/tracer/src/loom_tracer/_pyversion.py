"""What this Python's bytecode looks like: the one place that reads ``sys.version_info``.

The hook tracer models CPython 3.11 to 3.14 (``KNOWN_PYTHONS``); each difference
between them that a handler cares about is one flag below, named after the
difference (``dis`` on each interpreter is the authority, Dynamo's handlers the
reference for what an opcode does). Everything else in the package asks these
flags instead of the version. On a Python the tracer does not know
(``BYTECODE_KNOWN`` false), the handlers whose opcodes exist still register, and
``trace_hook`` refuses every hook with ``unsupported_python`` rather than guess
what the new bytecode means.
"""

from __future__ import annotations

import sys
from typing import Final

_VERSION: Final[tuple[int, int]] = (sys.version_info[0], sys.version_info[1])
#: The CPython releases whose bytecode the tracer models. The test suites run on 3.11
#: to 3.13; 3.14's handlers follow its documented bytecode and Dynamo's (no 3.14
#: interpreter was available to run them yet).
KNOWN_PYTHONS: Final[tuple[tuple[int, int], ...]] = ((3, 11), (3, 12), (3, 13), (3, 14))
BYTECODE_KNOWN: Final[bool] = _VERSION in KNOWN_PYTHONS
PY_VERSION: Final[str] = f"{_VERSION[0]}.{_VERSION[1]}"
PY_TAG: Final[str] = f"cp{_VERSION[0]}{_VERSION[1]}"

PY311: Final[bool] = _VERSION == (3, 11)
PY312: Final[bool] = _VERSION >= (3, 12)
PY313: Final[bool] = _VERSION >= (3, 13)
PY314: Final[bool] = _VERSION >= (3, 14)

# 3.12: an exhausted FOR_ITER ends the loop through END_FOR (CPython skips END_FOR
# and does its stack effect itself; the tracer, as Dynamo, jumps to it with a
# placeholder value on the iterator).
FOR_ITER_EXITS_THROUGH_END_FOR: Final[bool] = PY312
# 3.12 only: END_FOR pops the value and the iterator; from 3.13 it pops the value and
# the next instruction (POP_TOP; 3.14's POP_ITER) pops the iterator.
END_FOR_POPS_ITERATOR: Final[bool] = PY312 and not PY313
# 3.12: LOAD_ATTR with the low oparg bit set behaves like 3.11's LOAD_METHOD.
LOAD_ATTR_HAS_METHOD_BIT: Final[bool] = PY312
# 3.13: the NULL (or the bound self) is pushed after the callable, not below it.
NULL_FOLLOWS_CALLABLE: Final[bool] = PY313
# 3.13: CALL_KW takes the keyword names from the stack; KW_NAMES is gone.
CALL_KW_REPLACES_KW_NAMES: Final[bool] = PY313
# 3.13: MAKE_FUNCTION takes only the code; SET_FUNCTION_ATTRIBUTE adds defaults,
# keyword defaults, annotations and the closure one by one.
FUNCTION_ATTRIBUTES_SET_APART: Final[bool] = PY313
# 3.13: CONVERT_VALUE, FORMAT_SIMPLE and FORMAT_WITH_SPEC replace FORMAT_VALUE.
FORMAT_VALUE_SPLIT: Final[bool] = PY313
# 3.13: TO_BOOL converts a condition to bool before a conditional jump or UNARY_NOT,
# and COMPARE_OP's oparg bit 16 asks for the comparison's result as a bool.
CONDITIONS_CONVERTED_TO_BOOL: Final[bool] = PY313
# 3.13: LOAD_CLOSURE is a pseudo-instruction; a LOAD_FAST of a cell variable's slot
# loads the cell itself.
LOAD_CLOSURE_IS_LOAD_FAST: Final[bool] = PY313
# 3.13: LOAD_FAST_LOAD_FAST, STORE_FAST_LOAD_FAST and STORE_FAST_STORE_FAST fuse two
# local accesses into one instruction.
FUSED_LOCAL_ACCESS: Final[bool] = PY313
# 3.14: LOAD_SMALL_INT, LOAD_FAST_BORROW (and its fused pair), POP_ITER and NOT_TAKEN.
NEW_LOADS_AND_HINTS: Final[bool] = PY314
# 3.14: a subscript is BINARY_OP's NB_SUBSCR (BINARY_SUBSCR is gone).
SUBSCRIPT_IS_BINARY_OP: Final[bool] = PY314
# 3.14: RETURN_CONST is gone (LOAD_CONST + RETURN_VALUE), and so is
# BUILD_CONST_KEY_MAP (BUILD_MAP).
RETURN_CONST_REMOVED: Final[bool] = PY314
CONST_KEY_MAP_REMOVED: Final[bool] = PY314
# 3.14: LOAD_COMMON_CONSTANT loads AssertionError (LOAD_ASSERTION_ERROR is gone) and a
# few builtins.
COMMON_CONSTANTS: Final[bool] = PY314
# 3.14: LOAD_SPECIAL loads __enter__ and __exit__ (BEFORE_WITH is gone).
WITH_LOADS_SPECIAL_METHODS: Final[bool] = PY314
# 3.14: CALL_FUNCTION_EX always has a kwargs slot, NULL when the call has no **.
CALL_FUNCTION_EX_ALWAYS_HAS_KWARGS: Final[bool] = PY314
