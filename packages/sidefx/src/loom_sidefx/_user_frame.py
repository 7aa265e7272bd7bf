"""The user's source line a refusal points at: one reader and one format for every ``where``.

FX nodes keep the Python traceback of the user code they came from
(``node.meta["stack_trace"]``, innermost frame last). :func:`user_frame` reads
the innermost frame of such a text, and ``str()`` of the :class:`UserFrame` it
returns is the one spelling of a place in every package's refusals:
``path:line in function``.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["UserFrame", "user_frame"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<function>\S+))?')


@dataclasses.dataclass(frozen=True, slots=True)
class UserFrame:
    """One frame of the user's code: ``str(frame)`` is ``path:line in function``.

    Example::

        frame = user_frame('File "/src/train.py", line 12, in step\\n    y = x.nonzero()')
        str(frame)  # '/src/train.py:12 in step'
    """

    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        place = f"{self.file}:{self.line}"
        return f"{place} in {self.function}" if self.function else place


def user_frame(stack_trace: str | None) -> UserFrame | None:
    """The innermost frame of a Python traceback text (``File "...", line N, in fn``
    lines, innermost last, as FX keeps in ``node.meta["stack_trace"]``), or ``None``
    when the text names no frame."""
    frames = list(_FRAME.finditer(stack_trace)) if stack_trace else []
    if not frames:
        return None
    last = frames[-1]
    return UserFrame(last["file"], int(last["line"]), last["function"] or "")
