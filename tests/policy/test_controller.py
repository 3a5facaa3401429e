"""The scheduler's side of the command protocol, with a real vLLM KVCacheManager and the
worker's replies scripted: grows are two-phase, shrinks drain, failures change nothing, and
every rank must answer before a command completes."""

from __future__ import annotations

import json

import pytest

from dynoff.policy.block_pool import GroupState
from dynoff.policy.config import DynamicOffloadConfig, PolicyConfig
from dynoff.policy.controller import LevelsDisagreeError, OffloadController
from dynoff.policy.geometry import KVLayout, plan_capacity
from dynoff.policy.latency import StepCost, StepShape
from dynoff.policy.messages import OffloadCommand, ResizeOutcome, StepReport
from tests.policy.kv_fixtures import BLOCK_SIZE, SPEC, make_manager, make_request

PAGE = 64 << 10  # 8 blocks per group with the fixture's 8 KiB blocks
STRIDES = [SPEC.page_size_bytes] * 4
LAYER_BYTES = 8 * PAGE  # frees 8 pages = 2 groups of 4 pages


def controller(tmp_path, schedule=(), num_ranks=1, policy=None, max_level=2):
    plan = plan_capacity(
        STRIDES, base_blocks=16, layer_bytes=LAYER_BYTES, max_level=max_level, page_size=PAGE
    )
    manager = make_manager(plan.num_blocks)
    config = DynamicOffloadConfig(
        policy=policy or PolicyConfig(rule="seed", cooldown_steps=0),
        trace_path=str(tmp_path / "trace.jsonl"),
        level_schedule=tuple(schedule),
    )
    layout = KVLayout(plan.num_blocks, tuple(STRIDES), PAGE)
    return OffloadController(config, plan, layout, manager.block_pool, num_ranks), manager


def ack(command: OffloadCommand, ok: bool = True, rank: int = 0, level: int = 0) -> StepReport:
    outcome = ResizeOutcome(
        command.command_id, rank, ok, "" if ok else "cuMemMap failed", remap_ms=9.0, sync_ms=6.5
    )
    return StepReport(
        step=command.step,
        level=level,
        forward_ms=10.0,
        num_decode_tokens=4,
        outcomes=(outcome,),
    )


def test_grow_is_two_phase(tmp_path) -> None:
    ctl, manager = controller(tmp_path, schedule=[(1, 1)])
    assert manager.block_pool.num_gpu_blocks == 16
    command = ctl.on_schedule_start(1, waiting=0, running=0)
    assert command is not None and command.target_level == 1
    assert command.map_groups == (2, 3)
    assert manager.block_pool.num_gpu_blocks == 16  # not allocatable before the ack
    assert ctl.on_schedule_start(2, 0, 0) is None  # one command in flight at a time
    ctl.on_report(ack(command, level=1))
    assert ctl.level == 1
    assert manager.block_pool.num_gpu_blocks == 32
    assert manager.block_pool.get_num_free_blocks() == 31


def test_failed_grow_changes_nothing(tmp_path) -> None:
    ctl, manager = controller(tmp_path, policy=PolicyConfig(rule="seed", cooldown_steps=0))
    command = ctl.on_schedule_start(1, waiting=3, running=0)  # pressure: the policy climbs
    assert command is not None and command.target_level == 1
    ctl.on_report(ack(command, ok=False))
    assert ctl.level == 0 and ctl.policy.level == 0
    assert manager.block_pool.num_gpu_blocks == 16
    assert ctl.elastic.invariant_violations() == []
    assert ctl.trace.summary()["resize_failures"] == 1


def test_shrink_drains_then_unmaps_after_the_lag(tmp_path) -> None:
    ctl, manager = controller(tmp_path, schedule=[(1, 1), (3, 0)])
    ctl.on_report(ack(ctl.on_schedule_start(1, 0, 0), level=1))
    # A request holding blocks in the tier's groups (free list pops from the head, where
    # the newly mapped blocks were put).
    request = make_request(list(range(10 * BLOCK_SIZE)))
    assert manager.allocate_slots(request, 10 * BLOCK_SIZE) is not None
    held = set(manager.get_block_ids(request.request_id)[0])
    assert held & set(range(16, 32))
    assert ctl.on_schedule_start(3, 0, 1) is None  # draining: nothing to unmap yet
    assert ctl.elastic.draining
    manager.free(request)
    assert ctl.on_schedule_start(4, 0, 0) is None  # drained at 4, lag of 2 steps
    assert ctl.on_schedule_start(5, 0, 0) is None
    command = ctl.on_schedule_start(6, 0, 0)
    assert command is not None and command.target_level == 0
    assert command.safe_after_step == 5
    assert len(command.unmap_groups) == 2
    ctl.on_report(ack(command, level=0))
    assert ctl.level == 0 and manager.block_pool.num_gpu_blocks == 16
    assert ctl.elastic.invariant_violations() == []


def test_every_rank_must_answer(tmp_path) -> None:
    ctl, manager = controller(tmp_path, schedule=[(1, 1)], num_ranks=2)
    command = ctl.on_schedule_start(1, 0, 0)
    ctl.on_report(ack(command, rank=0, level=1))
    assert ctl.inflight is command and ctl.level == 0
    ctl.on_report(ack(command, ok=False, rank=1))  # one rank failed: nothing changes
    assert ctl.inflight is None and ctl.level == 0
    assert manager.block_pool.num_gpu_blocks == 16


def test_trace_records_steps_and_level_changes(tmp_path) -> None:
    ctl, _ = controller(tmp_path, schedule=[(1, 1), (2, 2)])
    for step in (1, 2, 3):
        command = ctl.on_schedule_start(step, 0, 0)
        if command:
            ctl.on_report(ack(command, level=command.target_level))
    ctl.trace.close()
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step"]
    changes = [r for r in lines if r.get("event") == "level_change"]
    assert [r["to_level"] for r in changes] == [1, 2]
    # the device's stall is the change after the queued work drained, not the wait for it
    assert [(r["remap_ms"], r["sync_ms"], r["stall_ms"]) for r in changes] == [(9.0, 6.5, 2.5)] * 2
    assert {"t", "level", "capacity_blocks", "kv_util", "waiting", "draining", "latency_ms"} <= set(
        steps[0]
    )
    # the levels the policy weighs at the recorded level (its next one up to max level 2)
    assert [sorted(r["latency_ms"]) for r in steps] == [["0", "1"], ["1", "2"], ["2"]]
    assert ctl.trace.summary()["levels_visited"] == [0, 1, 2]
    assert ctl.trace.summary()["capacity_blocks_by_level"] == {0: 16, 1: 32, 2: 48}


def test_model_estimator_runs_in_the_controller(tmp_path) -> None:
    policy = PolicyConfig(
        rule="seed", estimator="model", proxy="model", min_samples=1, cooldown_steps=0
    )
    plan = plan_capacity(
        STRIDES, base_blocks=16, layer_bytes=LAYER_BYTES, max_level=2, page_size=PAGE
    )
    manager = make_manager(plan.num_blocks)
    config = DynamicOffloadConfig(policy=policy, h2d_GBps=55.0)
    layout = KVLayout(plan.num_blocks, tuple(STRIDES), PAGE)
    ctl = OffloadController(
        config, plan, layout, manager.block_pool, num_layers=8, layer_bytes=LAYER_BYTES
    )
    ctl.on_report(StepReport(0, 0, 10.0, 4))
    assert ctl.estimator.model is not None  # calibrated from the level-0 step
    assert ctl.estimator.model.h2d_bytes_per_s == 55e9
    command = ctl.on_schedule_start(1, waiting=2, running=4)
    assert command is not None and command.target_level == 1  # tiny layers: cheap to offload


def test_untimed_reports_leave_no_forward_in_the_trace(tmp_path) -> None:
    """Under async scheduling a report can come before any forward has finished; it carries
    no step (0 tokens, 0 ms) and must not read as a 0 ms step to the trace's readers. A step
    with nothing scheduled has a time but no tokens: not a decode time either. Neither feeds
    the estimator or joins the step mix the model proxy prices."""
    ctl, _ = controller(tmp_path)
    ctl.on_report(StepReport(step=1, level=0, forward_ms=0.0))
    ctl.on_report(StepReport(2, 0, 12.5, num_decode_tokens=3, num_prefill_tokens=40))
    ctl.on_report(StepReport(3, 0, 0.2))  # vLLM's early return: no tokens scheduled
    assert ctl.estimator.samples(0) == 0  # the timed step had prefill: not a decode sample
    assert list(ctl._mix) == [StepShape(3, 40)]
    ctl.on_report(StepReport(4, 0, 9.0, num_decode_tokens=3))
    assert ctl.estimator.measured(0) == 9.0
    ctl.trace.close()
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    forwards = [r for r in lines if r["kind"] == "forward"]
    assert [(r["step"], r["forward_ms"]) for r in forwards] == [(2, 12.5), (4, 9.0)]


def test_model_proxy_prices_the_recent_steps_not_the_last_one(tmp_path) -> None:
    """A slow link (one 512 KiB layer takes 20 ms): decode steps of ~8-12 ms cannot hide a
    level's copies, an 800 ms prefill step can. Right after that prefill step, with decode
    steps before it, the controller holds k = 0 although the level doubles the KV; priced
    on the last step alone (``mix_steps`` 1) it climbs."""
    truth = StepCost(4.0, ms_per_decode_token=1.0, ms_per_prefill_token=0.8)
    # 64 level-0 steps (the estimator refits every 16, so its last fit has seen the prefill
    # step): at k = 1 the 63 decode steps gain ~33 ms each, 2.4x the mix's time at k = 0,
    # more than the 2x KV the level adds here.
    steps = [StepShape(4 + 4 * (i % 2)) for i in range(63)] + [StepShape(4, 1000)]

    def run(mix_steps: int) -> OffloadCommand | None:
        policy = PolicyConfig(
            rule="seed",
            estimator="model",
            proxy="model",
            min_samples=3,
            cooldown_steps=0,
            mix_steps=mix_steps,
        )
        plan = plan_capacity(
            STRIDES, base_blocks=16, layer_bytes=LAYER_BYTES, max_level=2, page_size=PAGE
        )
        manager = make_manager(plan.num_blocks)
        config = DynamicOffloadConfig(policy=policy, h2d_GBps=LAYER_BYTES / 0.020 / 1e9)
        layout = KVLayout(plan.num_blocks, tuple(STRIDES), PAGE)
        ctl = OffloadController(
            config, plan, layout, manager.block_pool, num_layers=8, layer_bytes=LAYER_BYTES
        )
        for step, shape in enumerate(steps):
            ctl.on_report(
                StepReport(
                    step, 0, truth.step_ms(shape), shape.num_decode_tokens, shape.num_prefill_tokens
                )
            )
        model = ctl.estimator.model
        assert model is not None and model.layer_ms_per_prefill_token > 0
        return ctl.on_schedule_start(len(steps), waiting=4, running=8)

    assert run(mix_steps=64) is None  # 63 decode steps + 1 prefill step: the copies show
    command = run(mix_steps=1)  # the prefill step alone: the copies hide
    assert command is not None and command.target_level == 1


def test_a_level_measured_as_a_loss_drains_back_under_pressure(tmp_path) -> None:
    """``descend_under_pressure``: the controller explores level 1 under a queue, measures
    it at 4x the step time for 2x the KV, and steps back down while requests still wait. The
    pool is full, so an ordinary drain would abort; this one holds until the request in the
    tier finishes, then the tier is unmapped."""
    policy = PolicyConfig(rule="seed", cooldown_steps=0, min_samples=3, descend_under_pressure=True)
    ctl, manager = controller(tmp_path, policy=policy, max_level=1)
    for step in range(3):
        ctl.on_report(StepReport(step, 0, 10.0, num_decode_tokens=4))
    up = ctl.on_schedule_start(3, waiting=3, running=1)
    assert up is not None and up.target_level == 1  # L_1 unknown: explore
    ctl.on_report(ack(up, level=1))
    request = make_request(list(range(31 * BLOCK_SIZE)))  # every block, the tier's included
    assert manager.allocate_slots(request, 31 * BLOCK_SIZE) is not None
    assert manager.block_pool.get_num_free_blocks() == 0
    for step in range(4, 7):
        ctl.on_report(StepReport(step, 1, 40.0, num_decode_tokens=4))

    assert ctl.on_schedule_start(7, waiting=3, running=1) is None  # the drain starts
    assert ctl.elastic.draining and ctl._decision == "down-pressure"
    ctl.on_schedule_end(7)
    assert ctl.elastic.draining  # held: not aborted for the dry free list
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 15  # the tier's 16 left at once
    assert ctl.on_schedule_start(8, waiting=3, running=0) is None  # drained; the lag
    assert ctl.on_schedule_start(9, waiting=3, running=0) is None
    down = ctl.on_schedule_start(10, waiting=3, running=0)
    assert down is not None and down.target_level == 0 and len(down.unmap_groups) == 2
    ctl.on_report(ack(down, level=0))
    assert ctl.level == 0 and manager.block_pool.num_gpu_blocks == 16
    assert ctl.on_schedule_start(11, waiting=3, running=0) is None  # L_1 known: holds
    assert ctl.elastic.invariant_violations() == []
    ctl.trace.close()
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [e["decision"] for e in events if e.get("step") == 7 and "decision" in e] == [
        "down-pressure"
    ]


def test_a_drain_that_never_finishes_times_out_and_the_controller_decides_again(
    tmp_path,
) -> None:
    # A long request pins blocks of the tier; the forced level says 0, so the drain starts
    # and, held open past drain_timeout_steps, aborts with a trace event and a log line.
    policy = PolicyConfig(rule="seed", cooldown_steps=0, drain_timeout_steps=5)
    ctl, manager = controller(tmp_path, schedule=[(1, 1), (3, 0)], policy=policy)
    ctl.on_report(ack(ctl.on_schedule_start(1, 0, 0), level=1))
    request = make_request(list(range(10 * BLOCK_SIZE)))
    assert manager.allocate_slots(request, 10 * BLOCK_SIZE) is not None
    assert ctl.on_schedule_start(3, 0, 1) is None and ctl.elastic.draining
    for step in range(4, 8):
        assert ctl.on_schedule_start(step, 0, 1) is None and ctl.elastic.draining
    ctl.on_schedule_start(8, 0, 1)  # 5 steps after it began: aborted, then a new decision
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    aborted = [e for e in events if e.get("event") == "drain_aborted"]
    assert len(aborted) == 1 and aborted[0]["why"] == "timed out" and aborted[0]["step"] == 8
    assert ctl.level == 1 and ctl.elastic.invariant_violations() == []
    assert ctl.elastic.draining  # the forced 0 still stands: the controller drains anew
    assert ctl.elastic.drain_started_step == 8


def lost(command: OffloadCommand, level_now: int, processed: bool = True) -> StepReport:
    """A report whose outcome was lost: a timed step, and what the worker says it is at."""
    return StepReport(
        step=command.step + 1,
        level=level_now,
        forward_ms=10.0,
        num_decode_tokens=4,
        last_command=command.command_id if processed else command.command_id - 1,
        level_now=level_now,
    )


def test_a_lost_outcome_is_settled_by_the_level_the_workers_report(tmp_path) -> None:
    """Item 5 of the hardening issue: a lost report never freezes the policy. Past
    ``report_timeout_steps`` the command is settled by the level rank 0 says it is at once
    it has processed the command: a raise the workers made is committed, a lowering they
    refused leaves the tier mapped."""
    policy = PolicyConfig(rule="seed", cooldown_steps=0, report_timeout_steps=8)
    ctl, manager = controller(tmp_path, schedule=[(1, 1), (20, 0)], policy=policy)
    up = ctl.on_schedule_start(1, 0, 0)
    assert up is not None
    ctl.on_report(lost(up, level_now=1))
    for step in range(2, 10):  # within the bound: still waiting for the outcome
        assert ctl.on_schedule_start(step, 0, 0) is None and ctl.inflight is up
    ctl.on_schedule_start(10, 0, 0)
    assert ctl.inflight is None and ctl.level == 1
    assert manager.block_pool.num_gpu_blocks == 32  # the groups the workers mapped are used
    # The lowering: its outcome lost, the workers report the old level (they refused it).
    step = 20
    while (down := ctl.on_schedule_start(step, 0, 0)) is None:
        step += 1
    assert down.target_level == 0 and down.unmap_groups
    ctl.on_report(lost(down, level_now=1))
    s = step
    while ctl.inflight is down and s < step + 10:
        s += 1
        ctl.on_schedule_start(s, 0, 0)
    assert s == step + 9  # settled once the bound passed
    assert ctl.inflight is None and ctl.level == 1
    # The tier came back to the pool (its pages are mapped), and the forced schedule's
    # next drain of it has begun (free blocks: drained at once), not retired unmapped.
    again = ctl.elastic.groups_in(GroupState.DRAINING, GroupState.RECLAIMED)
    assert set(down.unmap_groups) == set(again)
    assert ctl.elastic.invariant_violations() == []
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    lost_events = [e for e in events if e.get("event") == "report_lost"]
    assert [e["applied"] for e in lost_events] == [True, False]


def test_without_word_from_the_workers_a_command_stays_open(tmp_path) -> None:
    """No report that the workers processed the command: settling it either way could hand
    out blocks on unmapped pages, so it stays open (and nothing else is commanded)."""
    policy = PolicyConfig(rule="seed", cooldown_steps=0, report_timeout_steps=4)
    ctl, manager = controller(tmp_path, schedule=[(1, 1)], policy=policy)
    up = ctl.on_schedule_start(1, 0, 0)
    assert up is not None
    ctl.on_report(lost(up, level_now=0, processed=False))
    for step in range(2, 40):
        assert ctl.on_schedule_start(step, 0, 0) is None
    assert ctl.inflight is up and manager.block_pool.num_gpu_blocks == 16


def test_a_restore_wait_reported_with_its_lowering_is_counted_in_that_lowerings_stall(
    tmp_path,
) -> None:
    """Seen on the H200 under vllm serve: the device had passed the restored layer before the
    worker built the report, so the restore wait came in the same report as the lowering's
    outcome. The trace must carry it after the change, where the stall report reads it."""
    from bench.serve_bench import change_stalls

    ctl, _ = controller(tmp_path, schedule=[(1, 1), (3, 0)])
    ctl.on_report(ack(ctl.on_schedule_start(1, 0, 0), level=1))
    step = 3
    while (down := ctl.on_schedule_start(step, 0, 0)) is None:
        step += 1
    report = ack(down, level=0)
    ctl.on_report(StepReport(**{**report.__dict__, "restore_wait_ms": 6.5}))
    ctl.trace.close()
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    rows = change_stalls([e for e in events if e["kind"] == "event"])
    assert [(r["from"], r["to"]) for r in rows] == [(0, 1), (1, 0)]
    assert rows[1]["restore_wait_ms"] == 6.5
    assert rows[1]["stall_ms"] == 2.5 + 6.5  # the ack's remap 9.0 - sync 6.5, and the wait


def test_the_emulated_links_serving_bandwidth_reaches_the_trace_and_the_run_summary(
    tmp_path,
) -> None:
    """A paced device home reports what its copies reached while serving; the controller
    writes it to the trace, and a serving run's summary gives its median (the fast-link
    report's ``link_GBps_achieved_serving``)."""
    from bench.serve_bench import plugin_summary

    ctl, _ = controller(tmp_path, schedule=[(1, 0)])
    for step, gbps in ((128, 371.0), (256, 385.5), (384, 388.0)):
        ctl.on_schedule_start(step, 0, 0)
        ctl.on_report(StepReport(step, 0, 0.0, link_GBps=gbps))
    ctl.on_report(StepReport(400, 0, 0.0))  # most reports carry none
    ctl.trace.close()
    trace = tmp_path / "trace.jsonl"
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    links = [e for e in events if e.get("event") == "link"]
    assert [(e["step"], e["GBps"]) for e in links] == [(128, 371.0), (256, 385.5), (384, 388.0)]
    assert plugin_summary(trace)["link_GBps_serving"] == 385.5


def test_a_serving_runs_summary_keeps_the_timed_steps(tmp_path) -> None:
    """The workers' timed forwards reach the trace, and a serving run's summary keeps them,
    compact, for ``bench.simulator --check-steps``; the untimed reports leave no row."""
    from bench.serve_bench import FORWARD_COLUMNS, plugin_summary

    ctl, _ = controller(tmp_path, schedule=[(1, 0)])
    shapes = {10: (64, 0, 20_000, 0), 11: (60, 2048, 19_000, 3_000_000), 12: (0, 0, 0, 0)}
    for step, (decode, prefill, context, pairs) in shapes.items():
        ctl.on_schedule_start(step, 0, 0)
        forward = 0.0 if step == 12 else 20.0 + step  # step 12: not timed
        report = StepReport(
            step, 0, forward, decode, prefill, num_context_tokens=context, prefill_pairs=pairs
        )
        ctl.on_report(report)
    ctl.trace.close()
    steps = plugin_summary(tmp_path / "trace.jsonl")["forward_steps"]
    assert steps["columns"] == list(FORWARD_COLUMNS)
    assert [row[1:] for row in steps["rows"]] == [
        [0, 30.0, 64, 0, 20_000, 0],
        [0, 31.0, 60, 2048, 19_000, 3_000_000],  # the prefill's attention pairs too
    ]
    assert all(row[0] >= 0.0 for row in steps["rows"])


def test_workers_at_another_level_with_no_change_in_flight_stop_serving(tmp_path) -> None:
    """On the H100 (2026-12-06) a torn start-up calibration left the workers at level 1
    while the scheduler served level 0 for a whole run, and nothing noticed: every report
    said level 1. With no command in flight the workers' level must be the scheduler's."""
    policy = PolicyConfig(rule="seed", cooldown_steps=0)
    ctl, _ = controller(tmp_path, schedule=[(1, 1)], policy=policy)
    ctl.on_report(StepReport(step=0, level=0, forward_ms=10.0, level_now=0))  # agree
    ctl.on_report(StepReport(step=0, level=1, forward_ms=10.0))  # level_now not reported
    with pytest.raises(LevelsDisagreeError, match="workers are at level 1 and the scheduler"):
        ctl.on_report(StepReport(step=0, level=1, forward_ms=10.0, level_now=1))
    # A change in flight: the workers may already be at its target.
    up = ctl.on_schedule_start(1, 0, 0)
    assert up is not None and ctl.inflight is up
    ctl.on_report(lost(up, level_now=1))
    ctl.on_report(ack(up, level=1))
    assert ctl.inflight is None and ctl.level == 1
    ctl.on_report(StepReport(step=2, level=1, forward_ms=10.0, level_now=1))
