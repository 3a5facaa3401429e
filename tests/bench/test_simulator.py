"""The simulator built on vLLM's real scheduler (fast-link issue, item 4): a short trace
replays as committed, and the plugin's defaults hold level 0 where the link is PCIe and
climb where an emulated fast link makes a level pay, on the same KV-bound load."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.simulator import ROOT, StepModel, read_trace, simulate

EXPECTED = Path(__file__).parent / "simulator_expected.json"


def trace(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "trace.jsonl"
    cmd = [sys.executable, "-m", "bench.traces", *args, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return read_trace(str(out))


def run(system: str, requests: list[dict], link: float = 55.3, kv_blocks: int = 6095) -> dict:
    args = argparse.Namespace(
        system=system,
        model=str(ROOT / "tests/models/qwen3-32b"),
        kv_blocks=kv_blocks,
        max_level=8,
        link_GBps=link,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        plugin_config="{}",
    )
    return simulate(args, StepModel(link_GBps=link), requests)


def test_a_short_trace_replays_as_committed(tmp_path: Path) -> None:
    result = run("stock", trace(tmp_path, "poisson", "--rate", "4", "--seconds", "10"))
    expected = json.loads(EXPECTED.read_text())
    assert result == expected, "the simulation changed: if on purpose, rewrite " + str(EXPECTED)


@pytest.mark.parametrize("link", [55.3, 390.0])
def test_the_defaults_climb_only_where_the_link_makes_a_level_pay(tmp_path: Path, link) -> None:
    requests = trace(tmp_path, "poisson", "--rate", "6", "--seconds", "20")
    stock = run("stock", requests, kv_blocks=700)  # KV-bound: requests queue for blocks
    plugin = run("plugin", requests, link=link, kv_blocks=700)
    assert plugin["completed"] == stock["completed"] == len(requests)
    if link < 100:  # PCIe: a level's copies never hide, the plugin stays at k = 0
        assert plugin["levels_visited"] == [0]
        assert plugin["mean_e2el_ms"] <= stock["mean_e2el_ms"] * 1.01
    else:  # GH200-class link: it climbs, and the queue for KV melts
        assert max(plugin["levels_visited"]) >= 1
        assert plugin["p99_ttft_ms"] < 0.5 * stock["p99_ttft_ms"]
        assert plugin["mean_e2el_ms"] < stock["mean_e2el_ms"]
