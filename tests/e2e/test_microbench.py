"""The per-level microbenchmark and its plots, end to end on vLLM's CPU engine (a generated
Llama): every level is reached through the level file, the KV capacity grows with the level,
every transition up and down has a measured cost, the profiler trace shows the prefetches,
and the three plots are written."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plots import drawn
from tests.procs import run_checked

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_microbench_sweeps_levels_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "microbench_small_cpu.json"
    cmd = [sys.executable, "-m", "bench.microbench", "--cpu", "--levels", "1", "2", "4"]
    cmd += ["--prompt-len", "256", "--decode-batch", "8", "--decode-tokens", "8"]
    cmd += ["--prefill-prompts", "2", "--mixed-prompts", "2", "--out", str(out)]
    cmd += ["--profile-level", "2"]
    cmd += ["--workdir", str(tmp_path / "work")]
    run_checked(cmd, tmp_path / "microbench.log")
    results = json.loads(out.read_text())
    levels = results["levels"]
    assert set(levels) == {"0", "0p", "1", "2", "4"}
    capacity = [levels[k]["kv_capacity_blocks"] for k in ("0", "1", "2", "4")]
    assert capacity == sorted(capacity) and capacity[0] < capacity[-1]
    for k in ("0", "1", "2", "4"):
        assert levels[k]["decode_ms"] > 0 and levels[k]["samples"]["decode"] >= 3
        assert levels[k]["prefill_ms"] > 0 and levels[k]["prefill_tokens"] > 0
    assert levels["4"]["h2d_copies"] > levels["1"]["h2d_copies"] > 0 == levels["0"]["h2d_copies"]
    for k in range(4):  # every transition up and back down, with its parts measured
        for key in (f"{k}->{k + 1}", f"{k + 1}->{k}"):
            cost = results["resize"][key]
            assert cost["remap_ms"] >= cost["driver_ms"] > 0 and cost["slots_changed"] > 0
    assert results["resize"]["1->0"]["copy_ms"] > 0  # lowering restores from pinned copies
    # The torch.profiler trace at level 2 shows the ops and the engine's prefetch ranges.
    trace = json.loads(gzip.decompress((tmp_path / results["profile_trace"]).read_bytes()))
    names = {str(e.get("name", "")) for e in trace["traceEvents"]}
    assert {"dynoff::wait_layer", "dynoff::prefetch_layer"} <= names
    assert any(n.startswith("dynoff.prefetch.L") for n in names)
    plots = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.plots",
            "microbench",
            str(out),
            "--out",
            str(tmp_path / "plots"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plots.returncode == 0, plots.stderr[-2000:]
    for name in ("microbench_h2d.png", "microbench_iteration.png", "microbench_resize.png"):
        assert drawn(tmp_path / "plots" / name), name
