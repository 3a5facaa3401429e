"""The memory audit of level changes (``bench.kv_audit``): vLLM's real scheduler with the
plugin's pool drives the plugin's real worker-side memory on the host backend (real page
remaps) through 0 -> 4 -> 0 while 32 requests decode under vLLM's async-scheduling order.
No live request's KV and no layer's weights may change; each injected fault must be seen."""

from __future__ import annotations

import argparse

import pytest

from bench.kv_audit import ROOT, run

pytestmark = pytest.mark.slow


def audit(fault: str = "none", batch_queue: int = 2) -> dict:
    args = argparse.Namespace(
        model=str(ROOT / "tests/models/qwen3-8b"),
        requests=32,
        seed=0,
        layers=36,
        kv_blocks=2048,
        max_level=4,
        schedule=None,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        batch_queue=batch_queue,
        check_every=16,
        fault=fault,
    )
    return run(args)


@pytest.mark.parametrize("batch_queue", [1, 2])
def test_no_live_kv_and_no_weights_change_through_the_level_changes(batch_queue: int) -> None:
    result = audit(batch_queue=batch_queue)
    assert result["violations"] == 0, result["first_violations"]
    assert result["levels_visited"] == [0, 1, 2, 3, 4, 3, 2, 1, 0]
    assert result["level_changes"] == 8
    # Every token of every request written once, and checked while live many times over.
    assert result["tokens_written"] == 12_943
    assert result["tokens_checked"] > 10 * result["tokens_written"]
    assert result["group_blocks"] == 64  # the H100's packed geometry, scaled down


@pytest.mark.parametrize(
    ("fault", "seen"),
    [
        ("unmap-live", "on unmapped groups"),
        ("stray-copy", "lost the KV of"),
        ("wrong-partner", "ran on bytes not its own"),
    ],
)
def test_each_injected_fault_is_seen(fault: str, seen: str) -> None:
    result = audit(fault)
    assert result["violations"] > 0
    assert seen in result["first_violations"][0], result["first_violations"][:3]
