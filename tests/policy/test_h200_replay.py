"""Replays the H200's regime b long-prompt run through the model proxy.

The run (``bench/results/serving/qwen3-32b_b_longprompt/dynamic_h200.json.gz``, Qwen3-32B bf16,
~4,096-token prompts) climbed k = 0 -> 5 under pressure and sustained 1.2 req/s against
stock's >= 1.85: it priced each level on the last step alone. Right after a ~0.85 s
chunked-prefill step, two 17.7 ms copies per level hide and the extra 224 blocks win; the
level is then held over the ~35 ms-per-level decode steps in between, where they do not.
At saturation 17% of the steps carried prefill and took 73% of the time: a level costs
~13% more time over that mix for 4% more KV.

The estimator is fed the run's timed steps in order, as the controller fed it; at every step
where the run decided "up", the policy's inputs are rebuilt from the trace.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from bench.common import read_results
from bench.serving import timed_forward
from dynoff.policy.algorithm import OffloadPolicy, Pressure
from dynoff.policy.config import DynamicOffloadConfig, PolicyConfig
from dynoff.policy.latency import LatencyEstimator, OffloadCostModel, StepCost, StepShape

RESULTS = Path(__file__).parents[2] / "bench/results/serving/qwen3-32b_b_longprompt"
RUN = RESULTS / "dynamic_h200.json.gz"
LAYERS, LAYER_BYTES = 64, 975_196_672  # Qwen3-32B bf16 (bench/results/microbench_*.json)
BLOCKS_AT_0, BLOCKS_PER_LEVEL = 5568, 224  # the run's log: groups of 32 blocks
H2D_GBPS = 53.0  # what the run priced with (the configured default then)


def capacity(level: int) -> int:
    return BLOCKS_AT_0 + BLOCKS_PER_LEVEL * level


def model_estimator() -> LatencyEstimator:
    """The estimator as the run's controller built it: the model proxy, calibrated from the
    fitted level-0 steps, the layer geometry and the default link bandwidth."""
    config = DynamicOffloadConfig(
        policy=PolicyConfig(rule="seed", estimator="model", proxy="model")
    )

    def calibrate(cost: StepCost) -> OffloadCostModel:
        return OffloadCostModel.from_step_cost(LAYERS, LAYER_BYTES, H2D_GBPS * 1e9, cost)

    return LatencyEstimator(config.policy, calibrate=calibrate)


def climbs(estimator: LatencyEstimator, level: int, mix: tuple[StepShape, ...]) -> bool:
    """Algorithm 1's test under pressure: C_{k+1} / L_{k+1} > C_k / L_k."""
    current, nxt = estimator.estimate(level, mix), estimator.estimate(level + 1, mix)
    assert current is not None and nxt is not None
    return capacity(level + 1) / nxt > capacity(level) / current


def test_the_recent_step_mix_holds_where_the_last_step_climbed() -> None:
    estimator = model_estimator()
    mix: deque[StepShape] = deque(maxlen=estimator.config.mix_steps)
    last_prefill: StepShape | None = None
    moved_from: set[int] = set()  # levels the run climbed from
    by_last_prefill: set[int] = set()  # ... that pricing the last prefill step climbs from
    by_mix: set[int] = set()  # ... that pricing the recent mix climbs from
    for record in read_results(RUN)["trace"]:
        if record["decision"] == "up":
            level = record["level"]
            moved_from.add(level)
            if climbs(estimator, level, tuple(mix)):
                by_mix.add(level)
            if last_prefill is not None and climbs(estimator, level, (last_prefill,)):
                by_last_prefill.add(level)
        if timed_forward(record):
            shape = shape_of(record)
            estimator.observe(record["level"], record["forward_ms"], shape)
            mix.append(shape)
            if not shape.decode_only:
                last_prefill = shape
    assert moved_from == {0, 1, 2, 3, 4}
    # Priced on the last long prefill step, as the run priced it, every level looks free ...
    assert by_last_prefill == moved_from
    # ... priced over the steps it is held for, no climb pays.
    assert by_mix == set()


def test_a_level_over_the_saturated_mix_costs_more_time_than_it_adds_kv() -> None:
    """The ratio behind the hold, checked against a measurement. Fit level 0 from the dynamic
    run's level-0 steps; price the steps the static k = 1 run served at saturation (KV over
    85%, 560 steps) at k = 0 and k = 1. The k = 1 price matches what static measured on
    those very steps, and L_1 / L_0 is above C_1 / C_0 = 1.04."""
    estimator = model_estimator()
    for record in timed_steps(RUN):
        if record["level"] == 0:
            estimator.observe(0, record["forward_ms"], shape_of(record))
    saturated = [r for r in timed_steps(RESULTS / "static_h200.json.gz") if r["kv_util"] > 0.85]
    assert {r["level"] for r in saturated} == {1}
    prefill = [r for r in saturated if r["prefill_tokens"]]
    assert 0.1 < len(prefill) / len(saturated) < 0.3  # 17% of the steps carry prefill ...
    decode = [r for r in saturated if not r["prefill_tokens"]]
    time_in_prefill = sum(r["forward_ms"] for r in prefill) / sum(
        r["forward_ms"] for r in saturated
    )
    assert time_in_prefill > 0.6  # ... and take 73% of the time
    for steps in (saturated, decode):
        mix = tuple(shape_of(r) for r in steps)
        measured = sum(r["forward_ms"] for r in steps) / len(steps)
        predicted = estimator.estimate(1, mix)
        assert predicted is not None
        assert abs(predicted / measured - 1) < 0.12, (predicted, measured)
    mix = tuple(shape_of(r) for r in saturated)
    l0, l1 = estimator.estimate(0, mix), estimator.estimate(1, mix)
    assert l0 is not None and l1 is not None
    assert l1 / l0 > capacity(1) / capacity(0) + 0.03


def test_descending_under_pressure_brings_the_run_back_from_level_5() -> None:
    """Where the run ended: level 5, requests waiting, every level 0..5 measured. Algorithm 1
    as the seed has it holds there. With ``descend_under_pressure``, pricing the run's last
    64 steps at each level, it steps down one level per decision to 0, and holds."""
    steps, levels = timed_steps(RUN), {}
    for descend in (False, True):
        estimator = model_estimator()
        mix: deque[StepShape] = deque(maxlen=estimator.config.mix_steps)
        for record in steps:
            estimator.observe(record["level"], record["forward_ms"], shape_of(record))
            mix.append(shape_of(record))
        assert min(estimator.samples(k) for k in range(6)) >= estimator.config.min_samples
        config = PolicyConfig(
            rule="seed",
            estimator="model",
            proxy="model",
            cooldown_steps=0,
            descend_under_pressure=descend,
        )
        policy = OffloadPolicy(config, max_level=32, capacity_blocks=capacity, estimator=estimator)
        policy.level = 5
        queue = Pressure(waiting=10, kv_utilization=0.99, mix=tuple(mix))
        levels[descend] = [policy.decide(queue).level for _ in range(7)]
    assert levels[False] == [5] * 7
    assert levels[True] == [4, 3, 2, 1, 0, 0, 0]


def timed_steps(path: Path) -> list[dict]:
    """The trace's steps that carry a timed forward with tokens."""
    return [r for r in read_results(path)["trace"] if timed_forward(r)]


def shape_of(record: dict) -> StepShape:
    return StepShape(record["decode_tokens"], record["prefill_tokens"])
