"""What a level change costs the engine, beyond the level's step time.

A climb k -> k+1 is priced (:class:`~dynoff.policy.algorithm.OffloadPolicy`, rule
``priced``) as

    E[T_{k+1}] = C_{k+1} / (L_{k+1} + ((S_up + S_down) + E_{k+1}) / H)

against E[T_k] = C_k / L_k, and taken only when it wins by the margin. L_{k+1} (the
latency model over the recent step mix) carries the copy time left exposed and the
piecewise-graph penalty; S_up and S_down are the engine stalls of changing in and back out
(:class:`SwitchCost`); H is the hold horizon: the cooldown, or, deep in a pressure episode,
as many steps as the episode has lasted so far (an episode that has lasted T steps is
expected to last about as long again).

E_{k+1} is the climb's exit: once the pressure ends the level is left only as fast as its
blocks free, and blocks are handed out across the whole pool, so about as long as a
request holds its blocks, X steps (:class:`RequestLifetimes`), while the batch the pressure
admitted drains; each of those steps pays what level k+1 costs over level k on the
draining batch, where fewer requests hide fewer copies, weighed by the share of the
requests still running (:meth:`~dynoff.policy.algorithm.OffloadPolicy.exit_ms`). On a fast
link with long outputs (1-4k tokens) a level whose copies hide only behind a burst's batch
is held for minutes after it: a loss the climb must price (the simulator, bursty long
outputs at 392 GB/s: level 6 held 120 s past the burst at 30 ms steps where level 0 ran
22 ms).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from dynoff.policy.latency import OffloadCostModel, StepCost, StepShape, StepTimeFit
from dynoff.policy.messages import Calibration


class SwitchCost:
    """Engine stall of one level change, per direction (ms).

    Measured changes under load (the slowest rank's ``remap_ms``) replace the start-up
    calibration, which ran on an idle device: until then the stall is the calibrated change
    plus one step (a change waits for the step already queued on the device).

    A level's first entry also waits for its homes to be page-locked (``pin_homes:
    "first_raise"``): ``lock_ms`` a level above the highest entered so far, once in the
    server's life (:meth:`first_entry_ms`; level 1's were locked by the calibration).
    """

    SMOOTHING = 0.3  # weight of the newest measured change

    def __init__(self) -> None:
        self.calibrated = {+1: 0.0, -1: 0.0}
        self.measured: dict[int, float] = {}
        self.lock_ms = 0.0
        self.highest_entered = 1  # the calibration enters level 1

    def calibrate(self, up_ms: float, down_ms: float, lock_ms: float = 0.0) -> None:
        self.calibrated = {+1: up_ms, -1: down_ms}
        self.lock_ms = lock_ms

    def entered(self, level: int) -> None:
        self.highest_entered = max(self.highest_entered, level)

    def first_entry_ms(self, level: int, target: int) -> float:
        """The locks a climb from ``level`` to ``target`` waits for: the levels on the way
        never entered before."""
        return self.lock_ms * max(0, target - max(level, self.highest_entered))

    def observe(self, direction: int, stall_ms: float) -> None:
        old = self.measured.get(direction)
        self.measured[direction] = (
            stall_ms if old is None else old + self.SMOOTHING * (stall_ms - old)
        )

    def stall_ms(self, direction: int, step_ms: float) -> float:
        if direction in self.measured:
            return self.measured[direction]
        return self.calibrated[direction] + step_ms

    def round_trip_ms(self, step_ms: float) -> float:
        """Changing in and back out."""
        return self.stall_ms(+1, step_ms) + self.stall_ms(-1, step_ms)


class RequestLifetimes:
    """How long a request holds KV blocks, in scheduler steps: from the step that first
    schedules it to the step that reports it finished, over the last ``WINDOW`` finished
    requests. A level's tier is freed only when every request holding a block of it has
    finished, so its exit takes about the lifetime of the longer-lived requests: the
    ``QUANTILE`` of those seen (None before ``MIN_SEEN``)."""

    WINDOW = 256
    QUANTILE = 0.9
    MIN_SEEN = 8

    def __init__(self) -> None:
        self._started: dict[str, int] = {}
        self._lifetimes: deque[int] = deque(maxlen=self.WINDOW)
        self._exit: int | None = None  # the quantile, until the next request finishes

    def started(self, request_id: str, step: int) -> None:
        self._started.setdefault(request_id, step)  # a resumed request keeps its start

    def finished(self, request_id: str, step: int) -> None:
        start = self._started.pop(request_id, None)
        if start is not None:
            self._lifetimes.append(step - start)
            self._exit = None

    @property
    def in_flight(self) -> int:
        return len(self._started)

    def exit_steps(self) -> int | None:
        if len(self._lifetimes) < self.MIN_SEEN:
            return None
        if self._exit is None:
            ordered = sorted(self._lifetimes)
            self._exit = ordered[min(len(ordered) - 1, int(self.QUANTILE * len(ordered)))]
        return self._exit


def noise_margin(relative_rms: float | None, mix_size: int, floor: float) -> float:
    """The default climb margin: twice the standard error of the proxy's mean over the mix,
    from the latency fit's relative scatter on single steps; never below ``floor``."""
    if relative_rms is None or mix_size < 1:
        return floor
    return max(floor, 2.0 * relative_rms / math.sqrt(mix_size))


def model_error(cal: Calibration, build: Callable[[StepCost], OffloadCostModel]) -> float:
    """How far the latency model under-prices a level it has not measured, on this
    machine: per calibrated decode batch, the measured level-1 / level-0 step ratio against
    the ratio the model (fitted to those level-0 steps) predicts; the worst batch, 0 when
    the model prices high or there are no level-1 rows. Contention between the copies and
    compute, and the piecewise path at large batches, are not in the model: this is the
    margin a climb into an unmeasured level must clear on top of the noise."""
    rows = [(b, full, k1) for b, full, _, k1 in cal.decode_steps if k1 > 0 and full > 0]
    if not rows:
        return 0.0
    fit = StepTimeFit()
    for batch, full, _ in rows:
        fit.observe(StepShape(batch), full)
    cost = fit.solve()
    if cost is None:
        return 0.0
    model = build(cost)
    errors = []
    for batch, full, k1 in rows:
        shape = StepShape(batch)
        predicted = model.step_ms(1, shape) / model.step_ms(0, shape)
        errors.append((k1 / full) / predicted - 1)
    return max(0.0, *errors)
