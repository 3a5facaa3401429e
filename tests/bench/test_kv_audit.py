"""The memory audit of level changes (``bench.kv_audit``): vLLM's real scheduler with the
plugin's pool drives the plugin's real worker-side memory on the host backend (real page
remaps) through 0 -> 4 -> 0 while 32 requests decode under vLLM's async-scheduling order.
No live request's KV and no layer's weights may change; each injected fault must be seen."""

from __future__ import annotations

import pytest

from bench.kv_audit import build_parser, run

pytestmark = pytest.mark.slow


def audit(
    fault: str = "none", batch_queue: int = 2, requests: int = 32, kv_blocks: int = 2048
) -> dict:
    args = build_parser().parse_args(
        [
            *("--requests", str(requests), "--kv-blocks", str(kv_blocks), "--max-level", "4"),
            *("--batch-queue", str(batch_queue), "--fault", fault),
        ]
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


def test_preempted_requests_recompute_and_no_live_kv_changes_while_kv_starved() -> None:
    """192 blocks for 48 requests: vLLM preempts (a preempted request's KV is gone and it
    recomputes it, from its own cached prefix blocks where they survived), the lowerings'
    drains wait for blocks under pressure, and still no live KV or weight changes."""
    result = audit(requests=48, kv_blocks=192)
    assert result["violations"] == 0, result["first_violations"]
    assert result["restarts"] > 0
    assert result["level_changes"] >= 2 and result["levels_visited"][-1] < 4


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
