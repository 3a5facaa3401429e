"""The fast-link report's arithmetic on hand-made serve_bench records: systems read from the
server's command (stock, the ceiling at 0.9, the plugin's policy and its static levels per
link), a rate sustained only while the server's queue does not grow, the ratios per link,
the emulation labelled, and both plots drawn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.fastlink import plot, report
from tests.bench.records import write_records
from tests.plots import drawn

SECONDS = 60


def record(
    config: dict[str, Any] | None,
    util: float,
    rate: float,
    achieved: float,
    grows: bool = False,
    workload: str = "sharegpt",
    failed: int = 0,
) -> dict[str, Any]:
    server = ["vllm", "serve", "m", "--gpu-memory-utilization", str(util)]
    run: dict[str, Any] = {"system": "stock" if config is None else "plugin"}
    if config is not None:
        server += ["--additional-config", json.dumps({"dynamic_offload": config})]
        calibration = {"h2d_GBps": 371.5 if config.get("home") == "device" else 53.2}
        run["plugin"] = {
            "levels_visited": [0, 4, 0] if "level_schedule" not in config else [0, 4],
            "level_changes": 2,
            "calibration": calibration,
            "level_timeline": [[0.0, 0], [12.5, 4], [50.0, 0]],
            # the pacer's reports while serving (device home only), lower at a higher rate
            "link_GBps_serving": 400.0 - rate if config.get("home") == "device" else None,
        }
    # The waiting queue, sampled every second: flat, or growing by a request a second.
    samples = [{"t": float(t), "waiting": float(t if grows else t % 2)} for t in range(SECONDS)]
    run |= {
        "server_command": server,
        "point": {
            "workload": workload,
            "trace": f"poisson --workload {workload} --rate {rate} --seconds {SECONDS}",
        },
        "client": {
            "request_throughput": achieved,
            "failed": failed,
            "mean_e2el_ms": 1000.0 * rate,
            "p99_e2el_ms": 3000.0 * rate,
            "p99_ttft_ms": 200.0,
            "median_tpot_ms": 30.0,
        },
        "server_metrics": {"peak": {}, "samples": samples},
    }
    return run


FAST = {"home": "device", "home_GBps": 390}


def test_systems_knees_and_ratios_per_link(tmp_path: Path) -> None:
    records = [
        record(None, 0.62, 10.0, 9.8),
        record(None, 0.62, 12.0, 11.7),
        record(None, 0.62, 14.0, 12.0, grows=True),  # stock's knee: its queue grows
        record(None, 0.9, 14.0, 13.8),
        record(None, 0.9, 16.0, 15.6),
        record(FAST, 0.62, 12.0, 11.8),
        record(FAST, 0.62, 14.0, 13.7),
        record(FAST, 0.62, 16.0, 14.1, grows=True),
        record({**FAST, "level_schedule": [[0, 4]]}, 0.62, 12.0, 11.8),
        record({**FAST, "level_schedule": [[0, 4]]}, 0.62, 14.0, 12.9, grows=True),
        record({**FAST, "level_schedule": [[0, 8]]}, 0.62, 12.0, 11.5, failed=1),
        record({}, 0.62, 12.0, 11.6),  # the defaults on the real link
        record({}, 0.62, 14.0, 12.1, grows=True),
    ]
    result = report(write_records(tmp_path, records))
    assert result["emulation"] is True and "EMULATION" in result["note"]
    sharegpt = result["workloads"]["sharegpt"]
    systems = sharegpt["systems"]
    assert set(systems) == {
        "stock",
        "stock_0.9",
        "dynamic@390GBps",
        "static_k4@390GBps",
        "static_k8@390GBps",
        "dynamic@host",
    }
    assert systems["stock"]["max_sustainable_rps"] == 11.7 and systems["stock"]["knee"] == "queue"
    assert systems["stock_0.9"]["knee"] is None  # sustained all it was offered: a lower bound
    fast = systems["dynamic@390GBps"]
    assert fast["max_sustainable_rps"] == 13.7 and fast["emulation"] is True
    assert fast["link_GBps_target"] == 390 and fast["link_GBps_achieved"] == 371.5
    assert fast["link_GBps_achieved_serving"] == 384.0  # the lowest of its runs' medians
    assert systems["dynamic@host"]["link_GBps_achieved_serving"] is None
    assert fast["levels_visited"] == [0, 4] and fast["timelines"]["14.0"][1] == [12.5, 4]
    assert systems["static_k8@390GBps"]["max_sustainable_rps"] is None  # a failed request
    assert systems["dynamic@host"]["emulation"] is False
    ratios = sharegpt["ratios"]
    assert ratios["390GBps"]["dynamic_over_stock"] == pytest.approx(13.7 / 11.7, abs=1e-4)
    assert ratios["390GBps"]["best_static"] == "static_k4@390GBps"
    assert ratios["390GBps"]["dynamic_over_best_static"] == pytest.approx(13.7 / 11.8, abs=1e-4)
    assert ratios["host"]["best_static"] is None and ratios["host"]["emulation"] is False
    assert ratios["ceiling"]["system"] == "stock_0.9"
    assert ratios["ceiling"]["ceiling_over_stock"] == pytest.approx(15.6 / 11.7, abs=1e-4)
    # Goals are read for the emulated link only; the real link is the no-harm issue's.
    assert result["goals"] == {
        "sharegpt@390GBps": {"over_stock_ge_1.10": True, "over_best_static_ge_1.0": True}
    }
    paths = plot(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["fastlink_latency.png", "fastlink_levels.png"]
    assert all(drawn(p) for p in paths)


def test_interference_is_carried_and_workloads_are_kept_apart(tmp_path: Path) -> None:
    interference = tmp_path / "interference.json"
    interference.write_text(json.dumps({"decode": {"device_paced": {"slowdown": 1.04}}}))
    records = [
        record(None, 0.62, 1.0, 0.98, workload="longoutput"),
        record(FAST, 0.62, 1.0, 0.99, workload="longoutput"),
        record(None, 0.62, 12.0, 11.7),
    ]
    result = report(write_records(tmp_path, records), str(interference))
    assert result["interference"]["decode"]["device_paced"]["slowdown"] == 1.04
    assert set(result["workloads"]) == {"longoutput", "sharegpt"}
    assert set(result["workloads"]["sharegpt"]["systems"]) == {"stock"}
    assert result["workloads"]["longoutput"]["ratios"]["390GBps"]["dynamic_over_stock"] == (
        pytest.approx(0.99 / 0.98, abs=1e-4)
    )


def test_a_rate_is_judged_over_its_arrivals_and_its_ttft(tmp_path: Path) -> None:
    """On the H100 (2026-12-06) ``vllm bench serve`` sent its first request 35 s after the
    server's queue was first sampled, and a long-output trace fills the KV late: a window
    from 0 read an idle queue and called 0.8 req/s sustained where 0.2 was served. The
    window starts at the first request (the client's send, else the first busy sample),
    and a sustained rate keeps P99 TTFT within the simulator's bound."""
    late = record(None, 0.62, 0.8, 0.2, workload="longoutput")
    # idle 35 s, then running requests, and a queue that grows from t = 70 s
    late["server_metrics"]["samples"] = [
        {"t": float(t), "running": float(t >= 35), "waiting": float(max(0, t - 70))}
        for t in range(150)
    ]
    slow = record(None, 0.62, 0.5, 0.5, workload="slow")
    slow["client"]["p99_ttft_ms"] = 5000.0
    sent = record(None, 0.62, 0.8, 0.2, workload="sent")
    sent["server_metrics"]["samples"] = late["server_metrics"]["samples"]
    sent["client"]["traffic_start_s"] = 95.0  # its own first send: after the growth
    result = report(write_records(tmp_path, [late, slow, sent]))

    def only_row(report_: dict[str, Any], workload: str) -> dict[str, Any]:
        (system,) = report_["workloads"][workload]["systems"].values()  # stock alone
        (row,) = system["rates"]
        return row

    row = only_row(result, "longoutput")
    assert row["queue_window_s"] == [35.0, 95.0] and row["queue_slope"] > 0.3
    assert not row["sustainable"]
    row = only_row(result, "slow")
    assert row["queue_slope"] < 0.01 and not row["sustainable"]  # P99 TTFT 5 s
    assert only_row(result, "sent")["queue_window_s"] == [95.0, 155.0]
    assert "P99 TTFT <= 1000 ms" in result["sustained_rule"]
    lax = report(write_records(tmp_path, [slow]), ttft_bound_ms=6000.0)
    assert only_row(lax, "slow")["sustainable"]


def test_an_overloaded_point_is_compared_at_its_offered_rate(tmp_path: Path) -> None:
    """The H100's long outputs (2026-12-06): one offered rate, both queues grew, so neither
    system has a max sustainable rate; the same arrivals' figures are compared instead,
    each ratio the plugin's over stock's, and only at rates both ran."""
    stock = record(None, 0.85, 0.8, 0.143, grows=True, workload="longoutput")
    ours = record(FAST, 0.85, 0.8, 0.175, grows=True, workload="longoutput")
    ours["client"].update(mean_e2el_ms=600.0, p99_ttft_ms=100.0, median_tpot_ms=24.0)
    alone = record(FAST, 0.85, 0.4, 0.39, workload="longoutput")  # stock did not run 0.4
    for run in (stock, ours, alone):
        run["machine"] = {"gpu": "NVIDIA H100 80GB HBM3"}
    result = report(write_records(tmp_path, [stock, ours, alone]))
    assert result["gpus"] == ["NVIDIA H100 80GB HBM3"]  # the card the emulation ran on
    paths = plot(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["fastlink_latency_h100.png", "fastlink_levels_h100.png"]
    ratios = result["workloads"]["longoutput"]["ratios"]["390GBps"]
    assert ratios["dynamic_over_stock"] is None  # stock sustained no rate
    (point,) = ratios["at_same_rate"]
    assert point["target_rate"] == 0.8 and point["both_sustained"] is False
    assert point["throughput"] == pytest.approx(0.175 / 0.143, abs=1e-4)
    assert point["mean_e2el"] == pytest.approx(600.0 / 800.0, abs=1e-4)
    assert point["p99_e2el"] == pytest.approx(1.0) and point["p99_ttft"] == 0.5
    assert point["median_tpot"] == pytest.approx(0.8)
    stock["machine"] = {"gpu": "NVIDIA H200"}  # a ratio across two cards is refused
    with pytest.raises(ValueError, match="several GPUs"):
        report(write_records(tmp_path, [stock, ours]))
