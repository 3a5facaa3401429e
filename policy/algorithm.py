"""The per-step offloading decision: the seed's Algorithm 1, and the priced rule (default).

Rule ``seed``, Algorithm 1 as the seed has it, with cooldown and warm-up:

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

Rule ``priced`` (the default) keeps the thresholds and the cooldown and changes what a
climb must show, so that a level which does not pay is not tried (on a 55 GB/s PCIe link a
Qwen3-32B layer copies in 17.7 ms against a 25-40 ms decode step: almost never):

    under pressure:  if level k measured as a loss (the audit): k -= 1     ("down-loss")
                     elif k < M, no audit open, k+1 not backed off, and
                          C_{k+1} / (L_{k+1} + (S_up + S_down) / H) > (1 + m) · C_k / L_k:
                          k += 1
                     [elif descend_under_pressure ...: k -= 1]
    low pressure:    as the seed

L comes from the latency model over the recent step mix (exposed copies and the piecewise
penalty included; L_{k+1} over the mix with C_{k+1}/C_k times the decode tokens, the
requests the extra KV admits), S from :class:`~dynoff.policy.pricing.SwitchCost`, H is the
cooldown or the pressure episode's length so far, whichever is longer, and m is
``climb_margin`` or, unset, the measured noise of the proxy
(:func:`~dynoff.policy.pricing.noise_margin`). An unknown L_{k+1} holds: nothing is
explored on a guess. While level k+1 has no measurements of its own, m is at least the
model's error on level 1 as the start-up calibration measured it
(:func:`~dynoff.policy.pricing.model_error`). The controller audits every climb
(:mod:`dynoff.policy.audit`) and reports a loss through :meth:`OffloadPolicy.lost`.

Warm-up (optional, the seed's): start at M and step down one level each time the current
level has ``warmup_samples`` decode-only measurements, until level 0 is measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dynoff.policy.audit import Backoff
from dynoff.policy.config import PolicyConfig
from dynoff.policy.latency import LatencyEstimator, StepShape
from dynoff.policy.pricing import SwitchCost, noise_margin


@dataclasses.dataclass(frozen=True)
class Pressure:
    """What the scheduler sees at a step."""

    waiting: int
    kv_utilization: float
    mix: tuple[StepShape, ...] = ()  # recent steps' compositions, oldest first
    step: int = 0  # the scheduler step (back-offs count in steps)
    auditing: bool = False  # priced: the last climb is still being measured


@dataclasses.dataclass(frozen=True)
class Decision:
    level: int
    reason: str  # cooldown, up, down, down-pressure, down-loss, hold, warmup, warmup-done
    proxy_current: float | None = None
    proxy_next: float | None = None  # priced: with the switching stall amortised
    margin: float | None = None  # priced: what the climb had to clear


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
        self.switch = SwitchCost()
        self.backoff = Backoff(config.loss_backoff_steps)
        self.episode = 0  # consecutive decisions under pressure
        self.unmeasured_margin = 0.0  # the model's error on a level it has not measured
        self._lost: int | None = None  # a level the audit measured as a loss

    def proxy(self, level: int, mix: tuple[StepShape, ...]) -> float | None:
        """E[T_k] = C_k / L_k (blocks per ms)."""
        latency = self.estimator.estimate(level, mix if self.config.proxy == "model" else ())
        if latency is None or latency <= 0:
            return None
        return self.capacity_blocks(level) / latency

    def decide(self, pressure: Pressure) -> Decision:
        """One decision of the configured rule; updates and returns the level."""
        high = pressure.waiting > 0 or pressure.kv_utilization > self.config.high_threshold
        self.episode = self.episode + 1 if high else 0
        if self.warming_up:
            return self._warmup_step()
        if self.cooldown > 0:
            self.cooldown -= 1
            return Decision(self.level, "cooldown")
        if self.config.rule == "priced":
            return self._priced(pressure, high)
        return self._seed(pressure, high)

    def lost(self, level: int, step: int) -> int:
        """The audit measured ``level`` as a loss: leave it at the next decision, and keep
        out of it for the back-off. Returns the step it may be tried again."""
        if level == self.level:
            self._lost = level
        return self.backoff.lost(level, step)

    def paid(self, level: int) -> None:
        self.backoff.paid(level)

    def margin(self, mix_size: int, level: int | None = None) -> float:
        """What a climb into ``level`` must clear: ``climb_margin`` if set; else the
        proxy's noise, and, while ``level`` has no measurements of its own, at least the
        model's calibrated error on an unmeasured level."""
        cfg = self.config
        if cfg.climb_margin is not None:
            return cfg.climb_margin
        margin = noise_margin(self.estimator.fit.relative_rms(), mix_size, cfg.min_climb_margin)
        if level is not None and not self.estimator.refined(level):
            margin = max(margin, self.unmeasured_margin)
        return margin

    def priced_next(self, mix: tuple[StepShape, ...]) -> float | None:
        """C_{k+1} / (L_{k+1} + (S_up + S_down) / H), or None while L is unknown.

        L_{k+1} is priced over the mix as level k+1 would run it: with the KV full, the
        extra capacity admits proportionally more requests, so every step decodes
        C_{k+1}/C_k times the tokens (prefill chunks stay within the token budget). On a
        batch that is already compute-bound the longer steps eat the extra capacity, on
        any link; the seed's C_{k+1}/L_{k+1} over the same steps counts it as pure gain."""
        grow = self.capacity_blocks(self.level + 1) / self.capacity_blocks(self.level)
        admitted = tuple(
            StepShape(round(s.num_decode_tokens * grow), s.num_prefill_tokens) for s in mix
        )
        nxt = self.estimator.estimate(self.level + 1, admitted)
        now = self.estimator.estimate(self.level, mix)
        if nxt is None or now is None or nxt <= 0:
            return None
        horizon = max(self.config.cooldown_steps, self.episode, 1)
        nxt += self.switch.round_trip_ms(now) / horizon
        return self.capacity_blocks(self.level + 1) / nxt

    def _priced(self, pressure: Pressure, high: bool) -> Decision:
        cfg = self.config
        if high:
            if self._lost == self.level and self.level > 0:
                self._lost = None
                return self._move(-1, "down-loss")
            mix = pressure.mix
            current = self.proxy(self.level, mix)
            nxt, margin = None, self.margin(len(mix), self.level + 1)
            blocked = pressure.auditing or self.backoff.blocked(self.level + 1, pressure.step)
            if current is not None and self.level < self.max_level and not blocked:
                nxt = self.priced_next(mix)
                if nxt is not None and nxt > current * (1 + margin):
                    return self._move(+1, "up", current, nxt, margin)
            below = self._better_below(mix, current)
            if below is not None:
                return self._move(-1, "down-pressure", current, below)
            return Decision(self.level, "hold", current, nxt, margin)
        if pressure.kv_utilization < cfg.low_threshold and self.level > 0:
            return self._move(-1, "down")
        return Decision(self.level, "hold")

    def _seed(self, pressure: Pressure, high: bool) -> Decision:
        cfg = self.config
        if high:
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
        self,
        delta: int,
        reason: str,
        current: float | None = None,
        nxt: float | None = None,
        margin: float | None = None,
    ) -> Decision:
        self.level += delta
        self.cooldown = self.config.cooldown_steps
        return Decision(self.level, reason, current, nxt, margin)

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
        if self._lost is not None and self._lost != level:
            self._lost = None
