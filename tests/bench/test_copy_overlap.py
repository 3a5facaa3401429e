"""``bench.microbench.copy_overlap`` reads a torch.profiler Chrome trace: the prefetch copies,
their streams, and how much of their time a kernel ran next to them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.microbench import copy_overlap


def event(cat: str, name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_counts_kernel_time_inside_each_copy_once(tmp_path: Path) -> None:
    events = [
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 10_000, 17),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20_000, 10_000, 17),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 40_000, 500, 17),  # too short
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 50_000, 17),  # not H2D
        event("kernel", "gemm", 2_000, 3_000, 7),  # 3 ms inside copy 1
        event("kernel", "norm", 4_000, 2_000, 7),  # overlaps the gemm: +1 ms, not +2
        event("kernel", "gemm", 29_000, 5_000, 7),  # 1 ms inside copy 2
        event("kernel", "gemm", 35_000, 1_000, 7),  # outside every copy
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert copy_overlap(path) == {
        "copies": 2,
        "copy_streams": [17],
        "kernel_streams": [7],
        "copy_ms": 20.0,
        "copy_ms_with_kernels_running": 5.0,
    }
