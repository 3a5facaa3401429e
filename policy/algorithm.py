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

    under pressure:  if level k measured as a loss (the audit): back to where its climb began
                     elif no audit open and one could judge a climb now (a saturated
                          window of steps behind), for the best j in reach
                          (k+1, k+2, k+4, ..., M) not backed off:
                          C'_j / (L_j + ((j - k) (S_up + S_down) + E_j) / H)
                              > (1 + m_j) · C_k / L_k:
                          k = j                                            ("up")
                     [elif descend_under_pressure ...: k -= 1]
    low pressure:    j = the lowest level at which the KV in use stays under τ_l;
                     k = j once Σ (L_k - L_j) over the calm steps >= (k - j) (S_up + S_down)
                     ("down"; else "hold-calm")

L comes from the latency model over the recent step mix (exposed copies and the piecewise
penalty included; L_j over the mix with C_j/C_k times the decode tokens, the requests the
extra KV admits), S from :class:`~dynoff.policy.pricing.SwitchCost`, E_j the climb's
exit (the level is held until its blocks free, about a request's lifetime, while the
batch drains: L_j - L_k on the draining batch, weighed by the requests it still holds;
:meth:`OffloadPolicy.exit_ms`), H is the cooldown or
the pressure episode's length so far, whichever is longer, and m_j is ``climb_margin`` or,
unset, the measured noise of the proxy (:func:`~dynoff.policy.pricing.noise_margin`). An
unknown L_j holds: nothing is explored on a guess. While level j has no measurements of
its own, m_j is at least the model's error on level 1 as the start-up calibration measured
it (:func:`~dynoff.policy.pricing.model_error`).

Why a descent waits: leaving level k at the first calm step and climbing back when the
next burst comes costs two stalls per level, and on a fast link a level whose copies hide
costs little per step (the piecewise penalty), so a bursty load would hop up and down on
every lull. Staying is rent (the step time k costs over j, each calm step), descending is a
purchase (the round trip's stalls): descend once the rent paid equals the purchase, the
ski-rental rule, which never pays more than twice the better of the two choices in
hindsight. On PCIe a level costs its exposed copies every step (17.7 ms a Qwen3-32B layer),
so the rent passes the round trip within a step or two and the descent is as prompt as
before; without an estimate for both levels it is immediate. ``max_calm_steps`` bounds the
wait whatever the model says.

Why look past k+1: the piecewise-graph penalty is paid once, at any k > 0, while each level
adds the same KV. On a fast link a level that hides its copies can lose at k = 1 (4% more KV
for a 7% slower step) and win at k = 4 or 8; a rule that looks one level ahead never gets
there. C'_j bounds the gain by the KV pressure: no more capacity counts than the waiting
requests need (the scheduler passes their blocks), and no more than the batch may still
grow (``max_num_seqs``), so a queue held back by the sequence limit never buys a level. A
climb of several levels runs one command per level and is audited as one
(:mod:`dynoff.policy.audit`): a loss returns to where it began and backs off the level
and every level above it.

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
    auditing: bool = False  # priced: the last climb is still being measured ...
    auditable: bool = True  # ... and whether a climb now could be (a saturated baseline)
    # priced: the KV blocks the waiting requests need (None: not known, no bound) ...
    demand_blocks: int | None = None
    # ... and how far the batch may still grow (max_num_seqs / running; None: no bound).
    batch_room: float | None = None
    # priced: a climb's exit, the steps a level is held past the pressure (None: not
    # known yet)
    exit_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    level: int
    # cooldown, up, down, down-pressure, down-loss, hold, hold-calm, warmup, warmup-done
    reason: str
    proxy_current: float | None = None
    proxy_next: float | None = None  # priced: the best level in reach, stalls amortised
    margin: float | None = None  # priced: what the climb to it had to clear
    priced_level: int | None = None  # priced: the level proxy_next is for


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
        self.episode = 0  # decisions under pressure since the episode began ...
        self._calm_run = 0  # ... which ends after a cooldown's worth of calm decisions
        self.unmeasured_margin = 0.0  # the model's error on a level it has not measured
        self._lost: int | None = None  # a level the audit measured as a loss ...
        self._lost_to = 0  # ... and the level its climb came from
        self.calm_ms = 0.0  # priced: step time level k cost over the level below, calm steps
        self.calm_steps = 0

    def proxy(self, level: int, mix: tuple[StepShape, ...]) -> float | None:
        """E[T_k] = C_k / L_k (blocks per ms)."""
        latency = self.estimator.estimate(level, mix if self.config.proxy == "model" else ())
        return self._per_ms(level, latency)

    def _per_ms(self, level: int, latency: float | None) -> float | None:
        """C_k / L_k for a given L_k, or None while it is unknown."""
        if latency is None or latency <= 0:
            return None
        return self.capacity_blocks(level) / latency

    def decide(self, pressure: Pressure) -> Decision:
        """One decision of the configured rule; updates and returns the level."""
        high = pressure.waiting > 0 or pressure.kv_utilization > self.config.high_threshold
        # A steady load keeps the KV near τ_h and dips under it for a step or two: that is
        # one episode, not many short ones (each would reset the horizon the stalls and a
        # climb's exit are amortised over).
        if high:
            self.episode, self._calm_run = self.episode + 1, 0
            self.calm_ms, self.calm_steps = 0.0, 0
        else:
            self._calm_run += 1
            if self._calm_run >= self.config.cooldown_steps:
                self.episode = 0
        if self.warming_up:
            return self._warmup_step()
        if self.cooldown > 0:
            self.cooldown -= 1
            return Decision(self.level, "cooldown")
        if self.config.rule == "priced":
            return self._priced(pressure, high)
        return self._seed(pressure, high)

    def lost(self, level: int, step: int, from_level: int | None = None) -> int:
        """The audit measured ``level`` (climbed to from ``from_level``, default one below)
        as a loss: go back to ``from_level`` at the next decision, and climb no higher than
        it for the back-off (the model priced ``level`` above the levels between and was
        wrong there; it is not trusted above ``from_level`` until the back-off ends).
        Returns the step a climb may be tried again."""
        start = level - 1 if from_level is None else min(from_level, level - 1)
        if level == self.level:
            self._lost = level
            self._lost_to = start
        return self.backoff.lost(start + 1, step)

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

    def reach(self, demand_blocks: int | None) -> list[int]:
        """The levels a climb from k is priced to: k+1, k+2, k+4, ... and M (a change of
        several levels runs one command per level, so the levels between are passed
        through, not served), up to the first that holds what the waiting requests need;
        a level beyond it adds KV nobody is asking for."""
        k, levels, step = self.level, [], 1
        while k + step <= self.max_level:
            levels.append(k + step)
            step *= 2
        if levels and levels[-1] != self.max_level:
            levels.append(self.max_level)
        if demand_blocks is not None:
            enough = self.capacity_blocks(k) + demand_blocks
            for i, level in enumerate(levels):
                if self.capacity_blocks(level) >= enough:
                    return levels[: i + 1]
        return levels

    def priced(
        self,
        level: int,
        mix: tuple[StepShape, ...],
        demand_blocks: int | None = None,
        batch_room: float | None = None,
        now_ms: float | None = None,
        exit_steps: int | None = None,
    ) -> float | None:
        """C'_j / (L_j + ((j - k) (S_up + S_down) + E_j) / H) for a level j above k, or
        None while L is unknown (E_j: the exit, :meth:`exit_ms`).

        L_j is priced over the mix as level j would run it: with the KV full, the extra
        capacity admits proportionally more requests, so every step decodes C_j/C_k times
        the tokens and its attention reads C_j/C_k times the KV (the extra capacity is
        filled with context; prefill chunks stay within the token budget). On a batch that is
        already compute-bound the longer steps eat the extra capacity, on any link; the
        seed's C_{k+1}/L_{k+1} over the same steps counts it as pure gain. C'_j is the
        capacity that buys anything: no more than C_k plus the waiting requests' blocks,
        nor more than the batch can still grow by (``max_num_seqs``); L_j keeps the full
        C_j/C_k growth, so a bound only ever lowers the price of a level."""
        now_blocks, blocks = self.capacity_blocks(self.level), self.capacity_blocks(level)
        grow = blocks / now_blocks
        admitted = tuple(
            StepShape(
                round(s.num_decode_tokens * grow),
                s.num_prefill_tokens,
                round(s.num_context_tokens * grow),
            )
            for s in mix
        )
        nxt = self.estimator.estimate(level, admitted)
        now = self.estimator.estimate(self.level, mix) if now_ms is None else now_ms
        if nxt is None or now is None or nxt <= 0:
            return None
        horizon = max(self.config.cooldown_steps, self.episode, 1)
        stalls = (level - self.level) * self.switch.round_trip_ms(now)
        stalls += self.switch.first_entry_ms(self.level, level)
        nxt += (stalls + self.exit_ms(level, exit_steps, admitted)) / horizon
        useful = float(blocks)
        if demand_blocks is not None:
            useful = min(useful, now_blocks + demand_blocks)
        if batch_room is not None:
            useful = min(useful, now_blocks * max(batch_room, 1.0))
        return useful / nxt

    # The exit's steps, as the batch of the pressure drains: a quarter of them at each of
    # these fractions of it (the midpoints of a linear decay).
    EXIT_BATCH = (0.125, 0.375, 0.625, 0.875)

    def exit_ms(self, level: int, exit_steps: int | None, mix: tuple[StepShape, ...]) -> float:
        """E_j: what holding ``level`` instead of k costs once the pressure ends, in the
        pressure's terms (0 while the exit or L is unknown; :mod:`~dynoff.policy.pricing`).

        The level is held until its blocks free, ``exit_steps`` X, while the requests the
        pressure admitted (``mix``, as level j runs it) finish: the batch drains from all of
        them to none. A step at a fraction f of the batch costs L_j - L_k at that batch,
        and delays f of the requests a step of the pressure serves: E_j = X · mean over f
        of f (L_j - L_k)(f · batch). A small batch hides fewer copies, so a level whose
        copies hide only behind the burst's batch pays for its exit; one that hides them
        on any batch pays its piecewise penalty, on fewer and fewer requests."""
        if not exit_steps or not mix or level <= self.level:
            return 0.0
        decode = sum(s.num_decode_tokens for s in mix) / len(mix)
        context = sum(s.num_context_tokens for s in mix) / len(mix)
        cost = 0.0
        for f in self.EXIT_BATCH:
            shape = (StepShape(max(1, round(decode * f)), 0, int(round(context * f, -3))),)
            high = self.estimator.estimate(level, shape)
            low = self.estimator.estimate(self.level, shape)
            if high is None or low is None:
                return 0.0
            cost += f * max(high - low, 0.0)
        return exit_steps * cost / len(self.EXIT_BATCH)

    def priced_next(self, mix: tuple[StepShape, ...]) -> float | None:
        """The price of level k+1 (:meth:`priced`, no demand bound)."""
        return self.priced(self.level + 1, mix)

    def _priced(self, pressure: Pressure, high: bool) -> Decision:
        cfg = self.config
        if high:
            if self._lost == self.level and self.level > 0:
                self._lost = None
                return self._move(self._lost_to - self.level, "down-loss")
            mix = pressure.mix
            now_ms = self.estimator.estimate(self.level, mix)  # L_k over the mix, once
            # The model proxy prices level k over the same mix: no second pass over it.
            if cfg.proxy == "model":
                current = self._per_ms(self.level, now_ms)
            else:
                current = self.proxy(self.level, mix)
            best: tuple[float, int, float] | None = None  # (price, level, margin)
            if current is not None and not pressure.auditing and pressure.auditable:
                for level in self.reach(pressure.demand_blocks):
                    if self.backoff.blocked(level, pressure.step):
                        break  # a loss there: it and every level above are out
                    price = self.priced(
                        level,
                        mix,
                        pressure.demand_blocks,
                        pressure.batch_room,
                        now_ms,
                        pressure.exit_steps,
                    )
                    margin = self.margin(len(mix), level)
                    if price is None:
                        continue
                    if best is None or price / (1 + margin) > best[0] / (1 + best[2]):
                        best = (price, level, margin)
            if current is not None and best is not None and best[0] > current * (1 + best[2]):
                price, level, margin = best
                return self._move(level - self.level, "up", current, price, margin, level)
            below = self._better_below(mix, current)
            if below is not None:
                return self._move(-1, "down-pressure", current, below)
            if best is None:
                return Decision(self.level, "hold", current, None, self.margin(len(mix)))
            return Decision(self.level, "hold", current, best[0], best[2], best[1])
        if pressure.kv_utilization < cfg.low_threshold and self.level > 0:
            target = self._low_target(pressure.kv_utilization)
            if self._rent_paid(target, pressure.mix):
                return self._move(target - self.level, "down")
            return Decision(self.level, "hold-calm")
        return Decision(self.level, "hold")

    def _rent_paid(self, target: int, mix: tuple[StepShape, ...]) -> bool:
        """One more calm step at level k: has the step time it cost over ``target`` since
        the pressure ended paid for the round trip (down now, back up on the next burst)?
        True at once when either level has no estimate, and after ``max_calm_steps``."""
        now = self.estimator.estimate(self.level, mix)
        low = self.estimator.estimate(target, mix)
        self.calm_steps += 1
        if now is None or low is None or self.calm_steps >= self.config.max_calm_steps:
            return True
        self.calm_ms += max(now - low, 0.0)
        return self.calm_ms >= (self.level - target) * self.switch.round_trip_ms(now)

    def _low_target(self, utilization: float) -> int:
        """Low pressure: the lowest level below k at which the blocks in use now still sit
        under τ_l (at least k - 1). Every level above it holds KV nobody uses and costs its
        copies on every step; stepping down one level per cooldown would keep paying them
        for cooldown x k steps after a burst. Staying under τ_l there keeps it low
        pressure, so the descent cannot turn into a climb."""
        used = utilization * self.capacity_blocks(self.level)
        target = self.level - 1
        while target > 0 and used < self.config.low_threshold * self.capacity_blocks(target - 1):
            target -= 1
        return target

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
        priced_level: int | None = None,
    ) -> Decision:
        self.level += delta
        self.cooldown = self.config.cooldown_steps
        self.calm_ms, self.calm_steps = 0.0, 0
        return Decision(self.level, reason, current, nxt, margin, priced_level)

    def _warmup_step(self) -> Decision:
        if self.estimator.samples(self.level) < self.config.warmup_samples:
            return Decision(self.level, "warmup")
        if self.level == 0:
            self.warming_up = False
            return Decision(self.level, "warmup-done")
        self.level -= 1
        return Decision(self.level, "warmup")

    def revert(self, level: int) -> None:
        """A level change failed on the workers: serve on at ``level`` (the target stays
        within ``max_level``, which an operator's cap may have lowered below it)."""
        self.level = min(level, self.max_level)
        if self._lost is not None and self._lost != level:
            self._lost = None
