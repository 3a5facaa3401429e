"""Algorithm 1 on scripted traces: expected level sequences for each regime."""

from __future__ import annotations

from dynoff.policy.algorithm import OffloadPolicy, Pressure
from dynoff.policy.config import PolicyConfig
from dynoff.policy.latency import LatencyEstimator, StepShape

DECODE = StepShape(num_decode_tokens=64)
HIGH = Pressure(waiting=5, kv_utilization=0.95, mix=(DECODE,))
LOW = Pressure(waiting=0, kv_utilization=0.10, mix=(DECODE,))
MID = Pressure(waiting=0, kv_utilization=0.70, mix=(DECODE,))


def capacity(level: int) -> int:
    return 1000 + 500 * level


def make(latency_by_level: dict[int, float], cooldown: int = 0, **kw: object) -> OffloadPolicy:
    config = PolicyConfig(rule="seed", cooldown_steps=cooldown, **kw)  # type: ignore[arg-type]
    estimator = LatencyEstimator(config)
    for level, ms in latency_by_level.items():
        estimator.observe(level, ms, DECODE)
    return OffloadPolicy(config, max_level=4, capacity_blocks=capacity, estimator=estimator)


def run(policy: OffloadPolicy, trace: list[Pressure]) -> list[int]:
    return [policy.decide(p).level for p in trace]


def test_sustained_pressure_with_rising_proxy_climbs_to_max() -> None:
    # Capacity grows 1.5x, 1.33x, ... per level; latency only 10% per level: proxy rises.
    policy = make({k: 30.0 * (1 + 0.1 * k) for k in range(5)})
    assert run(policy, [HIGH] * 6) == [1, 2, 3, 4, 4, 4]


def test_falling_proxy_stops_the_climb() -> None:
    # L_2 jumps (copy-bound): C_2/L_2 = 2000/80 < C_1/L_1 = 1500/31.
    policy = make({0: 30.0, 1: 31.0, 2: 80.0, 3: 90.0, 4: 100.0})
    assert run(policy, [HIGH] * 4) == [1, 1, 1, 1]
    decision = policy.decide(HIGH)
    assert decision.reason == "hold"
    assert decision.proxy_next is not None and decision.proxy_current is not None
    assert decision.proxy_next < decision.proxy_current


def test_low_pressure_descends_unconditionally_and_mid_holds() -> None:
    policy = make({k: 30.0 for k in range(5)})
    run(policy, [HIGH] * 3)
    assert policy.level == 3
    assert run(policy, [MID] * 2) == [3, 3]
    assert run(policy, [LOW] * 5) == [2, 1, 0, 0, 0]


def test_waiting_requests_count_as_high_pressure_at_low_utilisation() -> None:
    policy = make({k: 30.0 for k in range(5)})
    assert run(policy, [Pressure(waiting=1, kv_utilization=0.2, mix=(DECODE,))]) == [1]


def test_cooldown_holds_for_c_steps_after_a_change() -> None:
    policy = make({k: 30.0 for k in range(5)}, cooldown=3)
    assert run(policy, [HIGH] * 9) == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert run(policy, [LOW] * 5) == [3, 3, 3, 2, 2]


def test_unknown_next_latency_explores_upward() -> None:
    policy = make({0: 30.0})  # nothing measured above level 0
    assert run(policy, [HIGH] * 2) == [1, 2]


def test_warmup_visits_every_level_from_max_down() -> None:
    config = PolicyConfig(rule="seed", warmup=True, warmup_samples=2, cooldown_steps=0)
    estimator = LatencyEstimator(config)
    policy = OffloadPolicy(config, max_level=4, capacity_blocks=capacity, estimator=estimator)
    visited = [policy.level]
    for _ in range(40):
        if not policy.warming_up:
            break
        estimator.observe(policy.level, 30.0 + policy.level, DECODE)  # the worker's report
        estimator.observe(policy.level, 99.0, StepShape(4, 512))  # prefill: filtered out
        decision = policy.decide(HIGH)  # pressure is ignored while warming up
        if decision.level != visited[-1]:
            visited.append(decision.level)
    assert visited == [4, 3, 2, 1, 0]
    assert not policy.warming_up
    assert [estimator.measured(k) for k in range(5)] == [30.0, 31.0, 32.0, 33.0, 34.0]


def test_under_pressure_a_measured_loss_steps_down_only_when_asked() -> None:
    """The seed's rule climbs into an unmeasured level (L_2 unknown counts as L_1) and then,
    with L_2 measured at 80 ms (C_2 / L_2 = 25 against C_1 / L_1 = 48 blocks/ms; level 3,
    at 200 ms, is no climb), keeps it while requests wait. ``descend_under_pressure`` steps
    back down once level 2 has its ``min_samples`` measurements, and then holds: L_2 is
    known, so it does not climb again."""
    for descend, expected in ((False, [2, 2, 2, 2]), (True, [1, 1, 1, 1])):
        policy = make({0: 30.0, 1: 31.0, 3: 200.0}, descend_under_pressure=descend, min_samples=3)
        assert run(policy, [HIGH] * 2) == [1, 2]  # explores up into the unknown
        for _ in range(2):
            policy.estimator.observe(2, 80.0, DECODE)
        assert run(policy, [HIGH]) == [2]  # two samples of level 2: not yet judged
        policy.estimator.observe(2, 80.0, DECODE)
        decisions = [policy.decide(HIGH) for _ in range(4)]
        assert [d.level for d in decisions] == expected
        if descend:
            down = decisions[0]
            assert down.reason == "down-pressure"
            assert down.proxy_current == 2000 / 80.0 and down.proxy_next == 1500 / 31.0
            assert {d.reason for d in decisions[1:]} == {"hold"}


def test_the_margin_keeps_a_near_tie_where_it_is() -> None:
    """C_1 / L_1 = 1500 / 46 = 32.6 against C_0 / L_0 = 1000 / 30 = 33.3 blocks/ms: level 0
    is 2% better, under the 5% margin, so level 1 stays; a 1% margin steps down. (Level 2,
    at 200 ms, is no climb.)"""
    for margin, expected in ((0.05, 1), (0.01, 0)):
        policy = make({0: 30.0, 2: 200.0}, descend_under_pressure=True, descend_margin=margin)
        assert run(policy, [HIGH]) == [1]
        for _ in range(3):
            policy.estimator.observe(1, 46.0, DECODE)
        assert run(policy, [HIGH]) == [expected]


def test_the_priced_rule_descends_at_once_as_far_as_the_kv_in_use_allows() -> None:
    """Low pressure after a burst: 300 blocks in use at level 4 (3,000 blocks, U = 0.10).
    They stay under τ_l = 0.5 at every level down to 0 (1,000 blocks): one decision takes
    the target there, not one level per cooldown. With 700 in use (U = 0.23), level 0 would
    hold them at 0.70, above τ_l: the target is level 1 (1,500 blocks, 0.47)."""
    config = PolicyConfig(cooldown_steps=50, estimator="measured", proxy="decode")
    policy = OffloadPolicy(config, 4, capacity, LatencyEstimator(config))
    policy.level = 4
    decision = policy.decide(Pressure(waiting=0, kv_utilization=300 / 3000, mix=(DECODE,)))
    assert (decision.level, decision.reason) == (0, "down")
    policy.level, policy.cooldown = 4, 0
    decision = policy.decide(Pressure(waiting=0, kv_utilization=700 / 3000, mix=(DECODE,)))
    assert (decision.level, decision.reason) == (1, "down")
    policy.level, policy.cooldown = 4, 0
    decision = policy.decide(Pressure(waiting=0, kv_utilization=0.45, mix=(DECODE,)))
    assert decision.level == 3  # 1,350 in use: only one level down stays under τ_l
