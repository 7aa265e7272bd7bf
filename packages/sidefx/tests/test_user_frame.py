"""``user_frame`` reads the user's innermost frame from a traceback text, in one format."""

from __future__ import annotations

import traceback

from loom_sidefx import UserFrame, user_frame

# The shape of ``node.meta["stack_trace"]`` that Dynamo records (innermost frame last).
DYNAMO_TRACE = """\
  File "/home/user/project/train.py", line 40, in forward
    h = self.block(x)
  File "/home/user/project/blocks.py", line 12, in <lambda>
    return torch.nonzero(h)
"""


def test_the_innermost_frame_is_the_users_line() -> None:
    frame = user_frame(DYNAMO_TRACE)
    assert frame == UserFrame("/home/user/project/blocks.py", 12, "<lambda>")
    assert str(frame) == "/home/user/project/blocks.py:12 in <lambda>"


def test_a_real_traceback_reads_as_this_file() -> None:
    text = "".join(traceback.format_stack())
    frame = user_frame(text)
    assert frame is not None
    assert frame.file == __file__
    assert frame.function == "test_a_real_traceback_reads_as_this_file"
    assert str(frame) == f"{__file__}:{frame.line} in test_a_real_traceback_reads_as_this_file"


def test_a_frame_without_a_function_prints_file_and_line() -> None:
    frame = user_frame('File "hook.py", line 3')
    assert frame == UserFrame("hook.py", 3)
    assert str(frame) == "hook.py:3"


def test_no_frame_is_none() -> None:
    assert user_frame(None) is None
    assert user_frame("") is None
    assert user_frame("no traceback here") is None
