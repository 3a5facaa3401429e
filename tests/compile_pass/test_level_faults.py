"""A driver error at every operation of a level change, on real host-backend VMM ranges
(item 10 of the hardening issue, the CPU half): whichever driver call fails, the rank
reports the failure, stays at its old level with every mapping as it was and its weights
intact, and the same change succeeds when retried."""

from __future__ import annotations

import pytest
import torch

from dynoff.compile_pass.levels import LevelChanger, TornChangeError
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


def test_a_failed_restore_copy_leaves_the_rank_at_its_old_level(monkeypatch) -> None:
    """A lowering maps layer j's own pages, then copies it back from its home. When that copy
    fails (the device home's pacer on the H100, 2026-12-06), j must share its partner's
    region again and its pages go back to the pool: the KV undo then finds them. Before,
    the pages stayed taken, the KV undo found the pool empty, and the rank was torn."""
    levels = rig(1)
    before = snapshot(levels)
    copy_in = levels.engine._copy_in

    def failing(layer: int, what: str, timed: bool = False) -> None:
        if what == "restore":
            raise RuntimeError("the restore copy failed")  # a fault on demand
        copy_in(layer, what, timed)

    monkeypatch.setattr(levels.engine, "_copy_in", failing)
    outcome = levels.apply(DOWN)
    assert not outcome.ok and "the restore copy failed" in outcome.error
    assert snapshot(levels) == before and weights_intact(levels)
    monkeypatch.setattr(levels.engine, "_copy_in", copy_in)
    assert levels.apply(DOWN).ok and levels.level == 0 and weights_intact(levels)


def test_a_restore_that_cannot_be_undone_stops_the_rank(monkeypatch) -> None:
    """The restore fails and sharing the region again fails in the driver: the rank's
    weights match no level, and the change raises (the engine stops) instead of reporting a
    plain failure the scheduler would serve on."""
    levels = rig(1)
    arena = levels.placement.arena

    def failing(layer: int, what: str, timed: bool = False) -> None:
        arena._inject_failure(0)  # the undo's first driver call fails too
        raise RuntimeError("the restore copy failed")

    monkeypatch.setattr(levels.engine, "_copy_in", failing)
    with pytest.raises(TornChangeError, match="could not share layer 0's region again"):
        levels.apply(DOWN)
    arena._inject_failure(-1)


def test_a_home_that_cannot_be_page_locked_fails_the_raise_before_anything_moves(
    monkeypatch,
) -> None:
    # pin_homes "first_raise": the first entry into a level page-locks its two homes. The
    # driver refusing the second (cudaHostRegister: locked-memory limits, page-table
    # memory) cannot be had on demand, so it is injected: the rank reports the failure,
    # keeps level 0 as it was, and the raise succeeds once the lock does.
    import dynoff.compile_pass.placement as placement_module

    levels = host_level_changer(pin_homes="first_raise")
    before = snapshot(levels)
    calls = []

    def refuse_the_second(tensor: torch.Tensor) -> bool:
        calls.append(tensor.data_ptr())
        if len(calls) == 2:
            raise RuntimeError("cudaHostRegister of 98304 bytes failed (2)")
        return True

    monkeypatch.setattr(placement_module, "lock_host", refuse_the_second)
    outcome = levels.apply(UP)
    assert not outcome.ok and "cudaHostRegister" in outcome.error
    assert snapshot(levels) == before and weights_intact(levels)
    assert levels.placement.locked_levels == 0
    monkeypatch.undo()
    assert levels.apply(UP).ok and levels.level == 1
    assert levels.placement.locked_levels == 1
