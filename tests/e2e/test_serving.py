"""The serving driver end to end on vLLM's CPU engine with the plugin (a generated Llama):
open-loop arrivals at two rates, per-request latencies, the sustainability verdict, the
plugin's trace, and the serving plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plots import drawn
from tests.procs import run_checked

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("sweep", ["drain", "staircase"])
def test_serving_driver_measures_two_rates_and_plots(tmp_path: Path, sweep: str) -> None:
    workload = tmp_path / "tiny.json"
    requests = [
        {"segments": [[i, 40 + (i * 7) % 60]], "output": 16 + (i * 5) % 32} for i in range(200)
    ]
    workload.write_text(json.dumps({"name": "tiny", "count": 200, "requests": requests}))
    out = tmp_path / "serving_tiny_dynamic_cpu.json"
    cmd = [sys.executable, "-m", "bench.serving", "--cpu", "--system", "dynamic"]
    cmd += ["--workload", str(workload), "--rates", "1", "3", "--window", "10"]
    cmd += ["--warmup", "2", "--grace", "10", "--out", str(out)]
    if sweep == "staircase":  # the second rate starts with the first one's requests in flight
        cmd += ["--staircase", "--step-warmup", "2"]
        # and the model estimator, fitted to the engine's real step shapes as it serves
        cmd += ["--policy", json.dumps({"estimator": "model", "proxy": "model"})]
    run_checked(cmd, tmp_path / "serving.log")
    results = json.loads(out.read_text())
    assert [r["target_rate"] for r in results["rates"]] == [1.0, 3.0]
    assert results["settings"]["staircase"] == (sweep == "staircase")
    assert results["aborted"] == 0
    engine = results["engine"]  # `vllm serve`'s batch limits, and the KV cache they share
    assert engine["usage_context"] == "OPENAI_API_SERVER"
    assert engine["max_num_seqs"] > 0 and engine["kv_cache_blocks"] > 0
    for rate in results["rates"]:
        assert rate["measured_completed"] == rate["arrivals_in_window"] > 0
        assert 0.5 * rate["target_rate"] < rate["achieved_rate"] < 2 * rate["target_rate"]
        assert 0 < rate["ttft_ms"]["p50"] <= rate["ttft_ms"]["p99"]
        assert 0 < rate["tbt_ms"]["p50"] <= rate["e2e_ms"]["p50"]
        assert rate["sustainable"]  # a tiny model on 2 cores keeps up with 3 req/s
        assert len(rate["cdf_ms"]["e2e"]) == 101
    assert results["max_sustainable_rate"] == max(r["achieved_rate"] for r in results["rates"])
    trace = results["trace"]
    assert trace and {"level", "kv_util", "waiting", "decision"} <= set(trace[0])
    timed = [s for s in trace if s.get("forward_ms", 0) > 0]
    assert timed and all(s["decode_tokens"] + s["prefill_tokens"] > 0 for s in timed)
    if sweep == "staircase":  # the model, fitted from level-0 steps, prices the current level
        priced = [s["latency_ms"][str(s["level"])] for s in trace[len(trace) // 2 :]]
        assert priced and all(ms is not None and ms > 0 for ms in priced)
    plots = subprocess.run(
        [sys.executable, "-m", "bench.plots", "serving", str(out), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plots.returncode == 0, plots.stderr[-2000:]
    for stem in ("latency", "cdf", "trace", "batch", "maxrate"):
        assert drawn(tmp_path / f"serving_{stem}.png"), stem
