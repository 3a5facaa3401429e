"""One vLLM CPU engine per subprocess (``bench.cpu_engine_run``), shared by the end-to-end
tests on the small Llama and on the other decoder families."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.procs import run_checked


def run_engine(
    mode: str, model: str | Path, tmp: Path, tp: int = 1, pin_homes: str = "first_raise"
) -> dict:
    """Run ``bench.cpu_engine_run MODE MODEL`` in ``tmp`` and return its JSON output."""
    out, trace = tmp / f"{mode}-tp{tp}.json", tmp / f"{mode}-tp{tp}.jsonl"
    cmd = [sys.executable, "-m", "bench.cpu_engine_run", mode, str(model), str(out)]
    cmd += ["--tp", str(tp), "--pin-homes", pin_homes]
    if mode != "reference":
        cmd += ["--trace", str(trace)]
    env = dict(os.environ)
    if tp == 1 and mode != "live":  # identity: every request queued before the first step
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (the engine core in this process)
    if tp > 1:  # vLLM's CPU engine binds each rank's threads to its own core
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, sorted(os.sched_getaffinity(0))[:tp]))
    run_checked(cmd, tmp / f"{mode}-tp{tp}.log", env=env)
    return json.loads(out.read_text())
