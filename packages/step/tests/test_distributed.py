"""capture_step and DDP, in one process: the ranks' actions are ordered for a
minimum to be the most conservative, and a host synchronization inside a library
names that library's frame (DDP's with what capture_step does about it). The two-rank
agreement is tested in tests_integration/test_capture_step_ranks.py.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from loom_step import StepRefusalKind
from loom_step._distributed import Action
from loom_step._refusals import sync_refusal


def test_actions_are_ordered_from_the_most_conservative() -> None:
    order = [Action.REFUSE, Action.EAGER, Action.WARM_UP, Action.CAPTURE, Action.REPLAY]
    assert sorted(order) == order and min(Action.REPLAY, Action.WARM_UP) is Action.WARM_UP


def test_a_sync_inside_ddp_names_ddps_frame_and_what_capture_step_does_about_it() -> None:
    import torch.nn.parallel.distributed as ddp_module

    source = Path(ddp_module.__file__).read_text().splitlines()
    lineno = next(
        i + 1 for i, line in enumerate(source) if "self.logger.set_runtime_stats_and_log()" in line
    )

    def users_step() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()  # the user's line: the model's call

    stack = users_step()
    user_line = stack[-1].lineno
    stack.append(traceback.FrameSummary(ddp_module.__file__, lineno, "_pre_forward"))
    reason = sync_refusal(stack)
    assert reason is not None and reason.kind is StepRefusalKind.SYNC_OP
    assert reason.where == f"{__file__}:{user_line} in users_step"
    assert reason.origin == (
        f"torch/nn/parallel/distributed.py:{lineno} in _pre_forward: "
        "self.logger.set_runtime_stats_and_log()"
    )
    assert f"(synchronized in {reason.origin})" in str(reason)
    assert "_set_ddp_runtime_logging_sample_rate" in reason.hint


def test_a_sync_on_the_users_own_line_names_no_library_frame() -> None:
    def users_step() -> list[traceback.FrameSummary]:
        return traceback.extract_stack()

    reason = sync_refusal(users_step())
    assert reason is not None and reason.origin == ""
    assert "synchronized in" not in str(reason) and ".item()" in reason.hint
