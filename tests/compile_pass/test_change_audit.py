"""The change audit (``audit_changes``, a debug option): around a level change, on real
host-backend VMM ranges, the KV groups mapped before and after must keep their bytes and
every resident layer must hold its own weights; a change that alters either is reported in
its outcome, and the scheduler's trace carries it with the change."""

from __future__ import annotations

import json

import torch

from dynoff.compile_pass.levels import LevelChanger
from dynoff.policy.messages import OffloadCommand, StepReport
from tests.compile_pass.rigs import host_level_changer
from tests.policy.test_controller import ack, controller

UP = OffloadCommand(0, 1, 1, map_groups=(8, 9))
DOWN = OffloadCommand(1, 2, 0, unmap_groups=(8, 9))


def audited() -> LevelChanger:
    levels = host_level_changer()
    levels.audit = True
    for group in levels.kv.backed:  # KV bytes in every mapped group (the others fault)
        for live in levels.kv.group_bytes(group):
            live.copy_(torch.randint(-128, 127, live.shape, dtype=torch.int8))
    return levels


def round_trip(levels: LevelChanger) -> tuple[tuple[str, ...], tuple[str, ...]]:
    up = levels.apply(UP)
    levels.engine.prefetch(0)  # what a step at level 1 ends with
    down = levels.apply(DOWN)
    assert up.ok and down.ok, (up.error, down.error)
    return up.audit, down.audit


def test_a_clean_round_trip_alters_nothing() -> None:
    assert round_trip(audited()) == ((), ())


def test_a_lowering_that_writes_on_a_live_kv_group_is_reported() -> None:
    levels = audited()
    lower = levels.placement.lower_level

    def lower_astray(restore=None):  # the restore copy lands on group 0's page too
        pages = lower(restore)
        levels.kv.buffers[0].tensor[:64].fill_(7)
        return pages

    levels.placement.lower_level = lower_astray
    up, down = round_trip(levels)
    assert up == () and down == ("KV group 0 changed",)


def test_a_layer_restored_with_wrong_weights_is_reported() -> None:
    levels = audited()
    levels.engine.sources[4] = levels.engine.sources[0]  # layer 4 restored as layer 0
    up, down = round_trip(levels)
    assert up == () and down == ("layer 4 does not hold its own weights",)


def test_the_trace_carries_what_the_audit_found_with_the_change(tmp_path) -> None:
    from dynoff.policy.trace import summarize_trace

    ctl, _ = controller(tmp_path, schedule=[(1, 1)])
    up = ctl.on_schedule_start(1, 0, 0)
    report = ack(up, level=1)
    (outcome,) = report.outcomes
    found = type(outcome)(**{**outcome.__dict__, "audit": ("KV group 3 changed",)})
    ctl.on_report(StepReport(**{**report.__dict__, "outcomes": (found,)}))
    ctl.trace.close()
    trace = tmp_path / "trace.jsonl"
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    (change,) = [e for e in events if e.get("event") == "level_change"]
    assert change["audit"] == ["rank 0: KV group 3 changed"]
    assert summarize_trace(trace)["audit_failures"] == 1


def test_weights_reloaded_between_changes_are_no_false_alarm() -> None:
    """The GPU identity run (2026-12-06, H100) redrew every layer's weights, homes included,
    after the start-up calibration had changed levels once: an audit that kept the first
    change's checksums then flagged every resident layer at all 36 changes, while the
    outputs matched the engine without the audit token for token."""
    levels = audited()
    levels.apply(UP)
    levels.apply(DOWN)  # the calibration's round trip
    for pack in levels.placement.packs:  # a reload: new weights, and the homes with them
        pack.flat.add_(1)
        if pack.cpu is not None:
            pack.cpu.copy_(pack.flat)
    assert round_trip(levels) == ((), ())


def test_a_change_that_writes_on_a_resident_layer_is_reported() -> None:
    levels = audited()
    raise_level = levels.placement.raise_level

    def raise_astray():  # the raise also lands on resident layer 1's first page
        raise_level()
        levels.placement.packs[1].flat[:64].fill_(7)

    levels.placement.raise_level = raise_astray
    up, down = round_trip(levels)
    assert up == ("layer 1 changed",) and down == ()
