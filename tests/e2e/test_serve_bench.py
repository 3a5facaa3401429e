"""The serving benchmark's real surface on vLLM's CPU build: ``vllm serve`` (its API server)
with the README's plugin flags, and stock, each driven over HTTP by vLLM's own benchmark
client replaying a timed trace; then the no-harm report over the two.

A 4-layer Llama with a synthetic tokenizer (``bench.synth_tokenizer``) and a KV cache small
enough that the burst queues, so the plugin's policy has something to decide."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import traces
from bench.no_harm import report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SERVER_ARGS = [
    "--server-arg=--kv-cache-memory-bytes=4194304",
    "--server-arg=--max-model-len=2048",
    "--server-arg=--dtype=bfloat16",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from bench.synth_tokenizer import write

    tmp = tmp_path_factory.mktemp("serve")
    model = tmp / "tiny-llama"
    model.mkdir()
    shutil.copy(ROOT / "tests/models/tiny-llama/config.json", model)
    write(model)
    bursty, poisson = tmp / "bursty.jsonl", tmp / "poisson.jsonl"
    phases = traces.phases_bursty(0.5, 4.0, lull_s=2, burst_s=4, cycles=1)
    assert traces.write(bursty, traces.trace("sharegpt", phases, seed=3)) >= 10
    assert traces.write(poisson, traces.trace("sharegpt", [traces.Phase(2.0, 3.0)], seed=4)) >= 2
    out = {}
    for system in ("stock", "plugin"):  # two points on each server, one after the other
        out[system] = tmp / f"{system}.json"
        out[f"{system}_poisson"] = tmp / f"{system}_poisson.json"
        cmd = [sys.executable, "-m", "bench.serve_bench", "--system", system]
        cmd += ["--model", str(model), "--trace", str(bursty), "--out", str(out[system])]
        cmd += ["--point", json.dumps({"regime": "cpu", "workload": "bursty"})]
        cmd += ["--trace", str(poisson), "--out", str(out[f"{system}_poisson"])]
        cmd += ["--point", json.dumps({"regime": "cpu", "workload": "poisson"}), *SERVER_ARGS]
        if system == "plugin":
            cmd += ["--plugin-config", json.dumps({"host_page_size": 64 << 10})]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_both_servers_serve_every_request_of_the_trace(runs: dict[str, Path]) -> None:
    count = None
    for path in (runs["stock"], runs["plugin"]):
        result = json.loads(path.read_text())
        client = result["client"]
        assert client["failed"] == 0 and client["completed"] == client["num_prompts"]
        assert client["p99_ttft_ms"] > 0 and client["median_tpot_ms"] > 0
        assert client["failures"] == [] and "itls" not in client  # errors kept, arrays not
        count = count or client["completed"]
        assert client["completed"] == count  # the same trace, replayed by vLLM's client
        peak = result["server_metrics"]["peak"]  # sampled from the server's /metrics
        assert peak["running"] >= 1 and 0 < peak["kv_usage"] <= 1
    plugin = json.loads(runs["plugin"].read_text())
    assert "--worker-cls" in plugin["server_command"]  # the README's flags
    # the KV each allocated (vLLM's cache_config_info): the plugin's pool holds its top level
    level_0 = plugin["plugin"]["capacity_blocks_by_level"]["0"]
    assert plugin["server_kv_blocks"] > level_0 > 0
    stock = json.loads(runs["stock"].read_text())
    assert not any(a.startswith("--worker-cls") for a in stock["server_command"])
    assert stock["server_kv_blocks"] > 0
    for run in (stock, plugin):  # how vLLM's profile sized each (read from its log)
        assert set(run["server_profile"]) == {"kv_GiB", "peak_activation_GiB", "graph"}


def test_the_plugin_calibrates_decides_and_records_every_change(runs: dict[str, Path]) -> None:
    plugin = json.loads(runs["plugin"].read_text())["plugin"]
    calibration = plugin["calibration"]
    assert calibration["h2d_GBps"] > 0 and calibration["stall_up_ms"] > 0
    assert plugin["decisions"]  # the policy ran on every step
    assert len(plugin["level_change_stall_ms"]) == plugin["level_changes"]
    assert all(c["stall_ms"] > 0 for c in plugin["level_change_stall_ms"])
    assert all(c["blocked_ms"] >= c["stall_ms"] for c in plugin["level_change_stall_ms"])
    timeline = plugin["level_timeline"]  # the level trace's plot: its start and each change
    assert timeline[0][0] == 0.0 and len(timeline) == plugin["level_changes"] + 1
    assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)
    plan = plugin["plan"]  # the reclaim group the level-change report quotes
    assert plan["kv_layout"] == "per_layer" and plan["group_blocks"] >= 1
    assert plan["group_tokens"] > 0 and plan["group_tokens"] % plan["group_blocks"] == 0


def test_a_second_point_on_the_same_server_reports_only_its_own_steps(
    runs: dict[str, Path],
) -> None:
    first = json.loads(runs["plugin"].read_text())
    second = json.loads(runs["plugin_poisson"].read_text())
    assert (first["point_index"], second["point_index"]) == (0, 1)
    assert second["startup_s"] == first["startup_s"]  # one server, started once
    assert second["client"]["completed"] == second["client"]["num_prompts"] >= 2
    assert second["client"]["completed"] < first["client"]["completed"]
    # The trace segment of the second point holds its steps only: they begin after the
    # first point's last and run without a gap (how many depends on the lengths and on the
    # CPU's speed, so their count is not compared); the server's calibration is the same.
    one, two = first["plugin"], second["plugin"]
    assert one["first_step"] >= 1 and two["first_step"] > one["last_step"]
    assert two["steps"] == two["last_step"] - two["first_step"] + 1 > 0
    assert two["calibration"] == one["calibration"]
    for name in ("stock", "plugin"):
        peak = json.loads(runs[f"{name}_poisson"].read_text())["server_metrics"]["peak"]
        assert peak["preemptions"] >= 0  # counted from the point's own start


def test_the_no_harm_report_pairs_the_runs_point_by_point(runs: dict[str, Path]) -> None:
    result = report([str(p) for p in runs.values()])
    bursty, poisson = sorted(result["points"], key=lambda p: p["workload"])
    assert (bursty["workload"], poisson["workload"]) == ("bursty", "poisson")
    for point in (bursty, poisson):
        assert point["regime"] == "cpu"
        assert point["throughput_ratio"] > 0 and point["e2e_p99_ratio"] > 0
    assert result["failed_requests"] == {"stock": 0, "plugin": 0}
    assert result["unpaired"] == []


def test_the_fast_link_report_reads_the_systems_from_the_servers_commands(
    runs: dict[str, Path],
) -> None:
    """The same runs through the fast-link report: the plugin on its real link (here the
    CPU's host home), not an emulation; stock at the same memory setting."""
    from bench.fastlink import report as fastlink

    result = fastlink([str(p) for p in runs.values()])
    assert result["emulation"] is False
    for workload in ("bursty", "poisson"):
        systems = result["workloads"][workload]["systems"]
        assert set(systems) == {"stock", "dynamic@host"}
        assert systems["dynamic@host"]["link_GBps_target"] is None
        assert systems["dynamic@host"]["link_GBps_achieved"] > 0  # the start-up calibration
        assert systems["stock"]["failed_requests"] == 0
    assert result["goals"] == {}  # goals are read on an emulated fast link only
