"""``vllm serve`` (vLLM's API server on its CPU build) with the plugin, its metrics and its
status endpoint: an operator pins levels through the endpoint while requests run, and
``/metrics`` and the status agree on the level and on the changes counted."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench import main_job, serve_bench

pytestmark = pytest.mark.slow


def metric(lines: list[str], name: str, **labels: str) -> float | None:
    """The value of ``name`` whose labels include ``labels`` (None when absent)."""
    for line in lines:
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


class Load(threading.Thread):
    """Completions one after another, so the engine keeps stepping."""

    def __init__(self, port: int, model: str) -> None:
        super().__init__(daemon=True)
        self.port, self.model = port, model
        self.done, self.completed, self.errors = threading.Event(), 0, []

    def run(self) -> None:
        body = {"model": self.model, "prompt": "t5 t6 t7 t8", "max_tokens": 48}
        body["ignore_eos"] = True
        while not self.done.is_set():
            try:
                main_job.post_json(self.port, "/v1/completions", body)
                self.completed += 1
            except (OSError, ValueError) as e:
                self.errors.append(repr(e))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("metrics")
    model = main_job.model_dir(workdir, layers=4)
    plugin = {"host_page_size": 64 << 10, "policy": {"max_level": 2}}
    proc, port, log = main_job.start_server(model, workdir, plugin, main_job.server_env(True))
    try:
        serve_bench.wait_ready(proc, port, log, 600)
        load = Load(port, str(model))
        load.start()
        yield port, load, log
        load.done.set()
        load.join(timeout=60)
    finally:
        serve_bench.stop(proc)


def wait_level(port: int, level: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = main_job.get_json(port, "/dynamic_offload/status")
        if status["level"] == level and not status["inflight"]:
            return status
        time.sleep(0.5)
    raise AssertionError(f"level {level} not reached: {status}")


def metrics_agree(port: int, status: dict, timeout_s: float = 30) -> list[str]:
    """/metrics once the stat logger has read the board that ``status`` came from."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = main_job.plugin_metrics(port)
        if metric(lines, "vllm:dynoff_offload_level") == status["level"]:
            return lines
        time.sleep(0.5)
    raise AssertionError(f"/metrics never showed level {status['level']}")


def test_the_level_gauge_and_the_change_counter_follow_the_operators_pins(server) -> None:
    port, load, _ = server
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the board appears with the first scheduled step
        try:
            before = main_job.get_json(port, "/dynamic_offload/status")
            break
        except urllib.error.HTTPError as e:
            assert e.code == 503
            time.sleep(1)
    assert before["max_level"] == 2 and before["control_route"] == "enabled"
    ups, downs = before["changes"]["up"], before["changes"]["down"]

    reply = main_job.post_json(port, "/dynamic_offload/level", {"pin": 2})
    assert reply["applied"] and reply["status"]["pin"] == 2
    status = wait_level(port, 2)
    lines = metrics_agree(port, status)
    assert metric(lines, "vllm:dynoff_offload_level") == 2
    up_total = metric(lines, "vllm:dynoff_level_changes_total", direction="up")
    assert up_total == status["changes"]["up"] >= ups + 2 - before["level"] >= 2
    assert metric(lines, "vllm:dynoff_policy_decision", reason="pinned") == 1
    assert metric(lines, "vllm:dynoff_kv_capacity_blocks") == status["capacity_blocks"]
    assert status["capacity_blocks"] > before["capacity_blocks"] or before["level"] == 2
    stalls = metric(lines, "vllm:dynoff_level_change_stall_seconds_count", direction="up")
    assert stalls == up_total

    main_job.post_json(port, "/dynamic_offload/level", {"pin": 0})
    status = wait_level(port, 0)
    lines = metrics_agree(port, status)
    down_total = metric(lines, "vllm:dynoff_level_changes_total", direction="down")
    assert down_total == status["changes"]["down"] >= downs + 2 >= 2
    assert status["capacity_blocks"] == status["levels"][0]["capacity_blocks"]

    main_job.post_json(port, "/dynamic_offload/level", {"pin": None})  # the policy again
    assert main_job.get_json(port, "/dynamic_offload/status")["pin"] is None
    assert load.completed > 0 and load.errors == []


def test_a_request_outside_the_plan_is_refused_with_the_fix(server) -> None:
    port, _, _ = server
    with pytest.raises(urllib.error.HTTPError) as refused:
        main_job.post_json(port, "/dynamic_offload/level", {"pin": 9})
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"] == "pin 9 is outside levels 0..2"
    with pytest.raises(urllib.error.HTTPError) as bad:
        main_job.post_json(port, "/dynamic_offload/level", {"pin": "two"})
    assert bad.value.code == 400


def test_the_server_log_names_the_plugins_parts(server) -> None:
    _, _, log = server
    text = Path(log).read_text(errors="replace")
    assert "Loaded endpoint plugin dynamic_offload" in text
    assert "vllm.stat_logger_plugins" in text
