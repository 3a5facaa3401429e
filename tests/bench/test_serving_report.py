"""The serving report: the sustainability rule on queue samples, merging a system's split
sweep by rate, and the ratios the README quotes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.serving import queue_slope, sustainable
from bench.serving_report import batch_bands, load_systems, markdown, report, step_mix


def _entry(rate: float, achieved: float, queue_per_s: float) -> dict[str, Any]:
    """A rate whose waiting queue grows by ``queue_per_s`` over a 30 s window after 10 s."""
    samples = [[t / 2, round(max(0.0, (t / 2 - 10) * queue_per_s)), 50] for t in range(0, 81)]
    latency = {"p50": 100.0, "p99": 300.0}
    return {
        "target_rate": rate,
        "achieved_rate": achieved,
        "sustainable": True,  # recorded under an older rule: the report judges it again
        "queue_samples": samples,
        "window": [10.0, 40.0],
        "arrivals_in_window": round(30 * rate),
        "completed_in_window": round(30 * achieved),
        "ttft_ms": latency,
        "tbt_ms": latency,
        "e2e_ms": latency,
    }


def _write(tmp_path: Path, name: str, system: str, rates: list[dict[str, Any]]) -> Path:
    run = {
        "command": f"python3 -m bench.serving --system {system}",
        "machine": {"date": "2026-12-03T00:00:00+00:00", "gpu": "NVIDIA H200"},
        "system": system,
        "model": "/tmp/site/models/qwen3-32b",
        "workload": {"name": "sharegpt"},
        "gpu_memory_utilization": 0.62,
        "startup_s": 70.0,
        "settings": {"window": 30.0},
        "rates": rates,
    }
    path = tmp_path / name
    path.write_text(json.dumps(run))
    return path


def test_queue_slope_tells_a_growing_queue_from_a_flat_one() -> None:
    flat = [(t / 2, 3 + (t % 3), 10) for t in range(80)]  # jitters, does not grow
    growing = [(t / 2, t // 2, 10) for t in range(80)]  # one request per second
    assert abs(queue_slope(flat, 0.0, 40.0)) < 0.05
    assert abs(queue_slope(growing, 0.0, 40.0) - 1.0) < 0.05
    assert queue_slope(growing, 100.0, 200.0) == 0.0  # no samples in the window
    assert sustainable(0.1, 10.0) and not sustainable(0.5, 10.0)


def test_report_merges_split_sweeps_rescoring_and_ratios(tmp_path: Path) -> None:
    stock_low = _write(tmp_path, "a.json", "stock", [_entry(8, 7.9, 0.0), _entry(12, 11.8, 0.0)])
    stock_high = _write(tmp_path, "b.json", "stock", [_entry(12, 12.1, 0.0), _entry(14, 12.9, 1.0)])
    dynamic = _write(tmp_path, "c.json", "dynamic", [_entry(12, 12.0, 0.0), _entry(14, 13.8, 0.1)])
    static = _write(tmp_path, "d.json", "static", [_entry(6, 6.0, 0.0), _entry(9, 8.1, 2.0)])
    systems = load_systems([stock_low, stock_high, dynamic, static])

    stock = systems["stock"]
    assert [r["target_rate"] for r in stock["rates"]] == [8, 12, 14]
    assert stock["rates"][1]["achieved_rate"] == 12.1  # the later file wins a shared rate
    assert [r["sustainable"] for r in stock["rates"]] == [True, True, False]
    assert len(stock["sources"]) == 2

    result = report(systems, "b")
    assert result["max_sustainable_rate"] == {"stock": 12.1, "dynamic": 13.8, "static": 6.0}
    assert result["ratios"]["dynamic_over_stock"] == round(13.8 / 12.1, 3)
    assert result["ratios"]["dynamic_over_static"] == 2.3
    assert result["ratios"]["dynamic_over_prefetch"] is None
    assert result["missing_systems"] == ["stock-piecewise", "prefetch"]
    table = markdown(result)
    assert "| stock | 12.1 |" in table and "14 (12.9)" in table and "12 (12.1 ✓)" in table
    # dynamic sustained both rates it was offered: its maximum is only a lower bound
    assert result["lower_bounds"] == ["dynamic"]
    assert "| dynamic | ≥ 13.8 |" in table
    assert result["ratio_bounds"] == {
        "dynamic_over_stock": "lower bound",
        "dynamic_over_static": "lower bound",
    }


def test_a_sweep_that_stops_short_of_its_knee_bounds_the_ratios(tmp_path: Path) -> None:
    """A baseline that sustained every rate offered makes ours ÷ it an upper bound."""
    stock = _write(tmp_path, "a.json", "stock", [_entry(12, 12.0, 0.0), _entry(14, 13.0, 1.0)])
    dynamic = _write(tmp_path, "b.json", "dynamic", [_entry(12, 12.1, 0.0), _entry(14, 13.1, 1.0)])
    # sustained 12 and 14; an unsustainable *lower* rate (noise) does not make 14 a knee
    static = _write(
        tmp_path,
        "c.json",
        "static",
        [_entry(8, 7.5, 1.0), _entry(12, 11.9, 0.0), _entry(14, 13.5, 0.0)],
    )
    result = report(load_systems([stock, dynamic, static]), "b")
    assert result["systems"]["stock"]["knee"] == result["systems"]["dynamic"]["knee"] == "queue"
    assert not result["systems"]["static"]["knee_reached"]
    assert result["ratio_bounds"] == {
        "dynamic_over_stock": "exact",
        "dynamic_over_static": "upper bound",
    }
    assert result["ratios"]["dynamic_over_static"] == round(12.1 / 13.5, 3)


def test_completing_fewer_at_a_higher_rate_is_a_throughput_knee(tmp_path: Path) -> None:
    """With KV and max_num_seqs to admit every arrival (regime a), the waiting queue never
    grows: past the knee the backlog piles up in the running batch, and a higher offered rate
    completes fewer requests per second. That makes the best rate exact, not a lower bound."""
    stock = _write(
        tmp_path,
        "a.json",
        "stock",
        [_entry(16, 14.8, 0.0), _entry(20, 16.9, 0.0), _entry(23, 15.5, 0.0)],
    )
    dynamic = _write(tmp_path, "b.json", "dynamic", [_entry(16, 14.9, 0.0), _entry(20, 16.9, 0.0)])
    result = report(load_systems([stock, dynamic]), "a")

    assert all(r["sustainable"] for r in result["systems"]["stock"]["rates"])
    assert result["systems"]["stock"]["knee"] == "throughput"
    assert result["systems"]["stock"]["knee_reached"]
    assert result["systems"]["dynamic"]["knee"] is None  # still completing more at 20
    assert result["max_sustainable_rate"] == {"stock": 16.9, "dynamic": 16.9}
    assert result["ratio_bounds"] == {"dynamic_over_stock": "lower bound"}
    assert "| stock | 16.9 |" in markdown(result) and "| dynamic | ≥ 16.9 |" in markdown(result)


def test_batch_bands_show_where_throughput_stops_rising() -> None:
    """Steps of 20 ms up to a batch of 100, then time proportional to the batch: the bands'
    throughput rises, then stays flat however large the batch grows."""
    trace, t = [], 0.0
    for running in [0] * 5 + [r for r in range(10, 300, 10) for _ in range(30)]:
        kv_util = running / 300
        trace.append({"t": t, "running": running, "kv_util": kv_util, "waiting": 0, "level": 0})
        t += 0.02 if running <= 100 else 0.0002 * running
    bands = batch_bands(trace, band=50)

    assert [b["running"] for b in bands][:2] == [[0, 50], [50, 100]]  # idle steps left out
    assert all(b["steps"] >= 20 for b in bands)
    assert bands[0]["step_ms"] == 20.0
    assert bands[0]["requests_per_s"] < bands[1]["requests_per_s"] < bands[2]["requests_per_s"]
    assert {b["requests_per_s"] for b in bands[3:]} == {5000}  # compute-bound: flat
    assert abs(bands[-1]["kv_util"] - bands[-1]["running_mean"] / 300) < 0.01


def test_step_mix_prices_the_saturated_steps_per_level() -> None:
    """Per level, only timed steps above the KV threshold count; one prefill step of 400 ms
    among four 25 ms decode steps is a fifth of the steps and 80% of the time."""

    def step(level: int, kv: float, ms: float, decode: int, prefill: int) -> dict[str, Any]:
        return {
            "level": level,
            "kv_util": kv,
            "forward_ms": ms,
            "decode_tokens": decode,
            "prefill_tokens": prefill,
        }

    trace = []
    for _ in range(10):
        trace += [step(0, 0.95, 400.0, 20, 4096)] + [step(0, 0.95, 25.0, 22, 0)] * 4
        trace += [step(1, 0.95, 60.0, 22, 0)]  # 10 in all, below MIN_BAND_STEPS: left out
        trace += [step(0, 0.30, 20.0, 5, 0)]  # not saturated
        trace += [{"level": 0, "kv_util": 0.95, "t": 0.0}]  # no forward: untimed
    trace += [step(0, 0.95, 0.0, 0, 0)]  # an empty step
    (row,) = step_mix(trace)
    assert row == {
        "level": 0,
        "steps": 50,
        "prefill_step_share": 0.2,
        "prefill_time_share": 0.8,
        "decode_step_ms": 25.0,
        "prefill_step_ms": 400.0,
    }


def test_report_refuses_runs_from_another_setting(tmp_path: Path) -> None:
    stock = _write(tmp_path, "a.json", "stock", [_entry(12, 12.0, 0.0)])
    other = _write(tmp_path, "b.json", "dynamic", [_entry(12, 12.0, 0.0)])
    run = json.loads(other.read_text())
    run["engine"] = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    other.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match=r"b.json .*max_num_seqs 'unrecorded' vs 1024"):
        load_systems([stock, other])
    run["gpu_memory_utilization"] = 0.9
    other.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match=r"gpu_memory_utilization 0\.62 vs 0\.9"):
        load_systems([stock, other])
