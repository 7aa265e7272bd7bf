"""What this Python's bytecode looks like: the one place that reads ``sys.version_info``.

CPython 3.11 and 3.12 differ in a handful of opcodes the hook tracer cares
about (``PRECALL`` and ``POP_JUMP_FORWARD_IF_*`` in 3.11; ``END_FOR``,
``RETURN_CONST``, ``BINARY_SLICE`` and ``LOAD_ATTR``'s method bit in 3.12).
Everything else in the package asks these flags instead of the version. On a
Python the tracer does not know (``BYTECODE_KNOWN`` false), the handlers whose
opcodes exist still register, and ``trace_hook`` refuses every hook with
``unsupported_python`` rather than guess what the new bytecode means.
"""

from __future__ import annotations

import sys
from typing import Final

_VERSION: Final[tuple[int, int]] = (sys.version_info[0], sys.version_info[1])
#: The CPython releases whose bytecode the tracer models.
KNOWN_PYTHONS: Final[tuple[tuple[int, int], ...]] = ((3, 11), (3, 12))
BYTECODE_KNOWN: Final[bool] = _VERSION in KNOWN_PYTHONS
PY_VERSION: Final[str] = f"{_VERSION[0]}.{_VERSION[1]}"
PY_TAG: Final[str] = f"cp{_VERSION[0]}{_VERSION[1]}"

PY311: Final[bool] = _VERSION == (3, 11)
PY312: Final[bool] = _VERSION >= (3, 12)

# 3.12: an exhausted FOR_ITER jumps past the END_FOR at its target.
FOR_ITER_SKIPS_END_FOR: Final[bool] = PY312
# 3.12: LOAD_ATTR with the low oparg bit set behaves like 3.11's LOAD_METHOD.
LOAD_ATTR_HAS_METHOD_BIT: Final[bool] = PY312
