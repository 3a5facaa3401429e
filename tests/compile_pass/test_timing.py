"""The step timer reports the latest finished step, once, with its own level and shape."""

from __future__ import annotations

import time

from dynoff.compile_pass.timing import StepTimer, Timed


def test_cpu_timer_reports_each_finished_step_once() -> None:
    timer = StepTimer(cuda=False)
    assert timer.latest_finished() is None
    timer.start(Timed(step=0, level=1, decode_tokens=4, prefill_tokens=0))
    time.sleep(0.01)
    timer.stop()
    timed = timer.latest_finished()
    assert timed is not None and timed.step == 0 and timed.level == 1
    assert 5.0 < timed.forward_ms < 1000.0
    assert timer.latest_finished() is None
    timer.stop()  # a stop without a start records nothing
    assert timer.latest_finished() is None
