"""Algorithm 1 of the seed: the per-step offloading decision, with cooldown and warm-up.

    if cooldown > 0:               cooldown -= 1; hold
    elif waiting > 0 or U > τ_h:   if k < M and C_{k+1}/L_{k+1} > C_k/L_k: k += 1; cooldown = C
                                   [elif k > 0 and C_{k-1}/L_{k-1} > (1+m)·C_k/L_k: k -= 1; ...]
    elif waiting == 0 and U < τ_l: if k > 0: k -= 1; cooldown = C
    else:                          hold

The bracketed branch is ours, off by default (``descend_under_pressure``): the seed never
steps down while requests wait, so a level that costs more time than the KV it adds stays
until the queue clears. It needs level k measured (``min_samples`` decode-only steps), so
an exploratory climb is judged on what it measured, not on the guess that sent it up.

C_k is the KV capacity in blocks at level k, L_k the latency estimate. With the ``model``
proxy, L_k is the mean predicted step time over the recent steps' compositions (decode-only
and prefill-carrying steps in the proportions the server ran them) instead of a decode-only
step's: a level is held over all of them. Pricing one long prefill step alone, where the
copies hide, would raise k and then pay the copies on every decode step after it.
An unknown L_{k+1} (never measured, no model) counts as equal to L_k, so the policy explores
upward under pressure, as the seed's "start at M and adjust reactively" does.

Warm-up (optional, the seed's): start at M and step down one level each time the current
level has ``warmup_samples`` decode-only measurements, until level 0 is measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dynoff.policy.config import PolicyConfig
from dynoff.policy.latency import LatencyEstimator, StepShape


@dataclasses.dataclass(frozen=True)
class Pressure:
    """What the scheduler sees at a step."""

    waiting: int
    kv_utilization: float
    mix: tuple[StepShape, ...] = ()  # recent steps' compositions, oldest first


@dataclasses.dataclass(frozen=True)
class Decision:
    level: int
    reason: str  # "cooldown", "up", "down", "down-pressure", "hold", "warmup", "warmup-done"
    proxy_current: float | None = None
    proxy_next: float | None = None


class OffloadPolicy:
    """Decides the target offload level once per step.

    Args:
        config: thresholds, cooldown, warm-up and estimator switches.
        max_level: M, already validated against ⌊N/2⌋ and pinned memory.
        capacity_blocks: C_k, the KV capacity in blocks at level k.
        estimator: source of L_k.
    """

    def __init__(
        self,
        config: PolicyConfig,
        max_level: int,
        capacity_blocks: Callable[[int], int],
        estimator: LatencyEstimator,
    ) -> None:
        self.config = config
        self.max_level = max_level
        self.capacity_blocks = capacity_blocks
        self.estimator = estimator
        self.warming_up = config.warmup and max_level > 0
        self.level = max_level if self.warming_up else 0
        self.cooldown = 0

    def proxy(self, level: int, mix: tuple[StepShape, ...]) -> float | None:
        """E[T_k] = C_k / L_k (blocks per ms)."""
        latency = self.estimator.estimate(level, mix if self.config.proxy == "model" else ())
        if latency is None or latency <= 0:
            return None
        return self.capacity_blocks(level) / latency

    def decide(self, pressure: Pressure) -> Decision:
        """One step of Algorithm 1; updates and returns the level."""
        if self.warming_up:
            return self._warmup_step()
        if self.cooldown > 0:
            self.cooldown -= 1
            return Decision(self.level, "cooldown")
        cfg = self.config
        if pressure.waiting > 0 or pressure.kv_utilization > cfg.high_threshold:
            current = self.proxy(self.level, pressure.mix)
            nxt = None
            if self.level < self.max_level:
                nxt = self._next_proxy(pressure.mix, current)
                if current is None or (nxt is not None and nxt > current):
                    return self._move(+1, "up", current, nxt)
            below = self._better_below(pressure.mix, current)
            if below is not None:
                return self._move(-1, "down-pressure", current, below)
            return Decision(self.level, "hold", current, nxt)
        elif (
            pressure.waiting == 0 and pressure.kv_utilization < cfg.low_threshold and self.level > 0
        ):
            return self._move(-1, "down")
        return Decision(self.level, "hold")

    def _better_below(self, mix: tuple[StepShape, ...], current: float | None) -> float | None:
        """E[T_{k-1}] when descending under pressure is on, level k is measured and level
        k-1 beats it by the margin; else None."""
        if not self.config.descend_under_pressure or self.level == 0 or current is None:
            return None
        if self.estimator.samples(self.level) < self.config.min_samples:
            return None
        below = self.proxy(self.level - 1, mix)
        if below is None or below <= current * (1 + self.config.descend_margin):
            return None
        return below

    def _next_proxy(self, mix: tuple[StepShape, ...], current: float | None) -> float | None:
        nxt = self.proxy(self.level + 1, mix)
        if nxt is None and current is not None:
            # Unknown L_{k+1}: assume L_k, so the extra capacity decides (explore upward).
            return current * self.capacity_blocks(self.level + 1) / self.capacity_blocks(self.level)
        return nxt

    def _move(
        self, delta: int, reason: str, current: float | None = None, nxt: float | None = None
    ) -> Decision:
        self.level += delta
        self.cooldown = self.config.cooldown_steps
        return Decision(self.level, reason, current, nxt)

    def _warmup_step(self) -> Decision:
        if self.estimator.samples(self.level) < self.config.warmup_samples:
            return Decision(self.level, "warmup")
        if self.level == 0:
            self.warming_up = False
            return Decision(self.level, "warmup-done")
        self.level -= 1
        return Decision(self.level, "warmup")

    def revert(self, level: int) -> None:
        """A level change failed on the workers: serve on at ``level``."""
        self.level = level
