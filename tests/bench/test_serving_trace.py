"""The serving benchmark's per-step trace, read from a trace the real controller wrote."""

from __future__ import annotations

from bench.serving import trace_series
from dynoff.policy.messages import StepReport
from tests.policy.test_controller import controller


def test_trace_series_joins_each_step_with_its_forward(tmp_path) -> None:
    ctl, _ = controller(tmp_path)
    for step in range(1, 6):
        ctl.on_schedule_start(step, waiting=step, running=10)
        if step < 5:  # the last step's forward has not been reported yet
            ctl.on_report(StepReport(step, 0, 20.0 + step, num_decode_tokens=10 * step))
    ctl.trace.close()

    series = trace_series(tmp_path / "trace.jsonl")
    assert [s["step"] for s in series] == [1, 2, 3, 4, 5]
    assert [s["waiting"] for s in series] == [1, 2, 3, 4, 5]
    assert series[1]["forward_ms"] == 22.0 and series[1]["decode_tokens"] == 20
    assert series[1]["prefill_tokens"] == 0
    assert series[0]["decision"] == "up"  # a queue and no estimates yet: explore upward
    # what the policy weighed at step 3: level 0's mean of the two forwards reported so far
    assert series[2]["latency_ms"] == {"0": 21.5, "1": None}
    assert "forward_ms" not in series[-1]
    assert [s["step"] for s in trace_series(tmp_path / "trace.jsonl", limit=2)] == [1, 3, 5]
