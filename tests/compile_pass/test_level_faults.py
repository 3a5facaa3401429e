"""A driver error at every operation of a level change, on real host-backend VMM ranges
(item 10 of the hardening issue, the CPU half): whichever driver call fails, the rank
reports the failure, stays at its old level with every mapping as it was and its weights
intact, and the same change succeeds when retried."""

from __future__ import annotations

import pytest
import torch

from dynoff.compile_pass.levels import LevelChanger
from dynoff.policy.messages import OffloadCommand
from tests.compile_pass.rigs import host_level_changer

UP = OffloadCommand(0, 1, 1, map_groups=(8, 9))
DOWN = OffloadCommand(1, 2, 0, unmap_groups=(8, 9))


def rig(level: int) -> LevelChanger:
    levels = host_level_changer()
    if level:
        assert levels.apply(UP).ok
        levels.engine.prefetch(0)  # what a step at level 1 ends with
    return levels


def snapshot(levels: LevelChanger) -> tuple:
    packs = levels.placement.packs
    return (
        levels.level,
        levels.runtime.level,
        [packs[i].range.mapping() for i in range(len(packs))],
        sorted(levels.kv.backed),
        {i: levels.engine.holds(i) for i in levels.engine.destinations},
    )


def weights_intact(levels: LevelChanger) -> bool:
    """Every offloadable layer whose range holds its own weights shows its host copy."""
    packs, engine = levels.placement.packs, levels.engine
    return all(
        torch.equal(packs[i].flat, engine.sources[i])
        for i in engine.destinations
        if engine.holds(i) == i
    )


@pytest.mark.parametrize(("start", "command"), [(0, UP), (1, DOWN)], ids=["up", "down"])
def test_a_driver_error_at_any_operation_leaves_the_rank_at_its_old_level(start, command) -> None:
    failures = 0
    for fault in range(200):
        levels = rig(start)
        before = snapshot(levels)
        levels.placement.arena._inject_failure(fault)
        outcome = levels.apply(command)
        levels.placement.arena._inject_failure(-1)
        if outcome.ok:  # the fault lay past the change's last driver call
            break
        failures += 1
        assert "injected failure" in outcome.error
        assert snapshot(levels) == before, f"driver call {fault} left the rank changed"
        assert weights_intact(levels)
        assert levels.apply(command).ok, f"the retry after driver call {fault} failed"
        assert levels.level == command.target_level and weights_intact(levels)
    else:
        pytest.fail("no change succeeded in 200 tries")
    assert failures >= 8  # 10 driver calls up, 11 down, on this rig
