"""What this Python's bytecode looks like: the one place that reads ``sys.version_info``.

CPython 3.11 and 3.12 differ in a handful of opcodes the hook tracer cares
about (``PRECALL`` and ``POP_JUMP_FORWARD_IF_*`` in 3.11; ``END_FOR``,
``RETURN_CONST``, ``BINARY_SLICE`` and ``LOAD_ATTR``'s method bit in 3.12).
Everything else in the package asks these flags instead of the version.
"""

from __future__ import annotations

import sys
from typing import Final

PY311: Final[bool] = sys.version_info[:2] == (3, 11)
PY312: Final[bool] = sys.version_info[:2] >= (3, 12)
PY_TAG: Final[str] = f"cp{sys.version_info[0]}{sys.version_info[1]}"

# 3.12: an exhausted FOR_ITER jumps past the END_FOR at its target.
FOR_ITER_SKIPS_END_FOR: Final[bool] = PY312
# 3.12: LOAD_ATTR with the low oparg bit set behaves like 3.11's LOAD_METHOD.
LOAD_ATTR_HAS_METHOD_BIT: Final[bool] = PY312
