"""``bench.serve_bench``'s reading of ``vllm bench serve``'s result."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serve_bench import MetricsSampler, client_result


def test_the_clients_first_send_is_placed_on_the_samples_clock(tmp_path: Path) -> None:
    """``vllm bench serve`` stamps each request's send with ``time.perf_counter``; the
    metrics sampler's samples count from its own ``perf_counter`` start, so the first send
    lands among them (the fast-link report's queue window starts there)."""
    sampler = MetricsSampler(port=1)  # never started: only its clock is read
    sent = sampler.t0 + 35.0
    path = tmp_path / "client.json"
    path.write_text(json.dumps({"start_times": [sent + 2.0, sent], "errors": ["", ""]}))
    result = client_result(path, sampler.t0)
    assert result["traffic_start_s"] == 35.0
    assert "start_times" not in result and result["failures"] == []
    assert "traffic_start_s" not in client_result(path)  # no sampler, no placing
