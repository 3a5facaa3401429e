"""The prefetch engine's ledger of what each shared region holds, on real host-backend VMM
ranges: a layer never runs on its partner's weights without an error, and a lowering that
would restore the wrong layer is refused before it changes anything."""

from __future__ import annotations

import pytest
import torch

from dynoff.compile_pass.prefetch import WrongWeightsError
from dynoff.policy.messages import OffloadCommand
from tests.compile_pass.rigs import host_level_changer


@pytest.fixture
def rig():
    levels = host_level_changer()
    return levels, levels.placement, levels.engine


def test_the_ledger_follows_raises_prefetches_and_lowerings(rig) -> None:
    levels, placement, engine = rig
    assert all(engine.holds(layer) == layer for layer in engine.destinations)
    assert levels.apply(OffloadCommand(0, 1, 1, map_groups=(8, 9))).ok
    assert engine.holds(4) == 0  # layer 4's range aliases layer 0's pages
    engine.wait(0)  # the region holds layer 0: a step may start
    with pytest.raises(WrongWeightsError, match="layer 4 would run on layer 0's weights"):
        engine.wait(4)
    engine.prefetch(4)
    engine.wait(4)
    assert torch.equal(placement.packs[4].flat, placement.packs[4].cpu)
    with pytest.raises(WrongWeightsError, match="layer 0 would run on layer 4's weights"):
        engine.wait(0)  # the copy of 4 overwrote the region
    engine.prefetch(0)  # what a step at this level ends with
    assert levels.apply(OffloadCommand(1, 2, 0, unmap_groups=(8, 9))).ok
    assert [engine.holds(layer) for layer in (0, 4)] == [0, 4]
    for layer in (0, 4):
        assert torch.equal(placement.packs[layer].flat, placement.packs[layer].cpu)


def test_a_copy_superseded_by_its_partners_is_no_longer_waited_on(rig) -> None:
    levels, _, engine = rig
    assert levels.apply(OffloadCommand(0, 1, 1, map_groups=(8, 9))).ok
    engine.pending.add(0)  # as on CUDA: a copy of layer 0 in flight
    engine.prefetch(4)  # lands after it in the same region
    assert 0 not in engine.pending
    with pytest.raises(WrongWeightsError):
        engine.wait(0)


def test_lowering_with_the_partner_in_the_region_is_refused_unchanged(rig) -> None:
    levels, placement, engine = rig
    assert levels.apply(OffloadCommand(0, 1, 1, map_groups=(8, 9))).ok
    engine.prefetch(4)  # a step cut short: it never issued prefetch(0)
    before = (placement.packs[4].range.mapping(), sorted(levels.kv.backed))
    outcome = levels.apply(OffloadCommand(1, 2, 0, unmap_groups=(8, 9)))
    assert not outcome.ok and "holds layer 4's weights" in outcome.error
    assert levels.level == 1 and levels.runtime.level == 1
    assert (placement.packs[4].range.mapping(), sorted(levels.kv.backed)) == before


def test_a_rollback_that_fails_stops_the_rank_loudly_and_keeps_its_ops_truthful(rig) -> None:
    from dynoff.compile_pass.levels import RanksDivergedError

    levels, placement, _ = rig
    command = OffloadCommand(0, 1, 1, map_groups=(8, 9))
    assert levels.apply(command).ok  # another rank failed it: this one must undo it
    placement.arena._inject_failure(0)  # and the undo's first driver call fails
    with pytest.raises(RanksDivergedError, match="rank 0 could not roll command 0 back"):
        levels.revert(command, old_level=0)
    placement.arena._inject_failure(-1)
    assert levels.runtime.level == levels.level  # no op runs a placement that is not there


def failing(what: str):
    """Fault injection: a call that fails the way a driver error would."""

    def fail(*_args, **_kwargs):
        raise RuntimeError(f"injected: {what} failed")

    return fail


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_change_torn_half_way_stops_the_rank_instead_of_reporting_a_failure(
    rig, monkeypatch, direction: str
) -> None:
    """Item 5 of the hardening issue: the second half of a change fails and so does the undo
    of its first half (both injected; the first half runs on the real host arena). A plain
    failed outcome would make the scheduler keep (or return) blocks whose pages are gone;
    the rank raises TornChangeError instead, and its ops follow what its pages hold."""
    from dynoff.compile_pass.levels import TornChangeError

    levels, placement, engine = rig
    if direction == "down":
        assert levels.apply(OffloadCommand(0, 1, 1, map_groups=(8, 9))).ok
        engine.prefetch(0)  # what a step at level 1 ends with
        command = OffloadCommand(1, 2, 0, unmap_groups=(8, 9))  # the KV unmap runs for real
        monkeypatch.setattr(placement, "lower_level", failing("giving layer 4 its pages"))
        monkeypatch.setattr(levels.kv, "map_groups", failing("remapping the KV groups"))
    else:
        command = OffloadCommand(0, 1, 1, map_groups=(8, 9))  # the alias runs for real
        monkeypatch.setattr(levels.kv, "map_groups", failing("mapping the KV groups"))
        monkeypatch.setattr(placement, "lower_level", failing("un-aliasing layer 4"))
    with pytest.raises(TornChangeError, match="could not undo its first half"):
        levels.apply(command)
    assert levels.runtime.level == levels.level
