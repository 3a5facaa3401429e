"""What a climb bought: tokens served per second after it, against the window before.

The model prices a level before the climb; the audit measures the result. It keeps, per
scheduler step, the wall time and the tokens served (a prompt once, when its prefill
completes, and each token of output: :func:`dynoff.policy.scheduler.served_tokens`; not
the tokens computed, which count a recomputed prefix again), and whether the step was
under pressure. When a climb completes after a saturated run of steps (the longest among the
last ``window``, at least ``baseline`` long), the audit waits ``settle`` steps (the change
itself, the admissions it allows), then reads ``window`` steps after it. Only two saturated
windows compare: when the load falls away after the climb, throughput measures the load,
not the level, and there is no verdict.

Verdict ``loss`` when the rate after falls below the rate before by more than twice the
standard error of the difference (batch means over sub-windows of both windows), and by at
least ``tolerance``. The policy then leaves the level and does not climb into it again for
a back-off that doubles with each loss there (:class:`Backoff`). While an audit is open
the policy does not climb again: the next level's effect would mix into this one's. Nor
does it climb before the audit could judge the climb (:attr:`ChangeAudit.ready`): at start-up
or after a lull, a handful of steps is no baseline, and a price read off them is no price.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque


@dataclasses.dataclass(frozen=True)
class Window:
    tokens_per_s: float
    stderr: float  # of the per-step rates' mean
    pressured_share: float
    steps: int


@dataclasses.dataclass(frozen=True)
class Verdict:
    level: int
    from_level: int
    loss: bool
    before: Window
    after: Window

    @property
    def ratio(self) -> float:
        return self.after.tokens_per_s / self.before.tokens_per_s


def measure(samples: list[tuple[float, int, bool]], blocks: int = 5) -> Window | None:
    """``samples``: (step seconds, tokens, pressured) per step. The rate is the window's
    tokens over its seconds; its standard error comes from ``blocks`` consecutive
    sub-windows (batch means: a prefill step serves thousands of tokens, a decode step
    tens, so single steps' rates say little about a window's)."""
    timed = [(dt, n) for dt, n, _ in samples if dt > 0]
    if len(timed) < 2 * blocks:
        return None
    seconds = sum(dt for dt, _ in timed)
    rate = sum(n for _, n in timed) / seconds
    size = len(timed) // blocks
    parts = [timed[i * size : (i + 1) * size] for i in range(blocks)]
    rates = [sum(n for _, n in part) / sum(dt for dt, _ in part) for part in parts]
    mean = sum(rates) / blocks
    var = sum((r - mean) ** 2 for r in rates) / (blocks - 1)
    share = sum(1 for *_, p in samples if p) / len(samples)
    return Window(rate, math.sqrt(var / blocks), share, len(samples))


def is_loss(before: Window, after: Window, tolerance: float) -> bool:
    """The rate fell by more than twice the standard error of the difference and by more
    than ``tolerance`` of the rate before."""
    noise = 2.0 * math.hypot(before.stderr, after.stderr)
    drop = before.tokens_per_s - after.tokens_per_s
    return drop > max(noise, tolerance * before.tokens_per_s)


class ChangeAudit:
    """Measures each climb against the window before it (see the module docstring)."""

    def __init__(
        self,
        window: int,
        settle: int,
        tolerance: float,
        saturated_share: float = 0.9,
        baseline: int | None = None,
    ) -> None:
        self.window = window
        self.settle = settle
        self.tolerance = tolerance
        self.saturated_share = saturated_share
        self.baseline = window if baseline is None else min(baseline, window)
        self._recent: deque[tuple[float, int, bool]] = deque(maxlen=window)
        self._last_time: float | None = None
        self._open: tuple[int, int, Window] | None = None  # (from, to, before)
        self._after: list[tuple[float, int, bool]] = []
        self._before: list[tuple[float, int, bool]] | None = None  # taken when a climb begins
        self._skip = 0

    def observe(self, now_s: float, tokens: int, pressured: bool) -> Verdict | None:
        """One scheduler step: its start time, the tokens it served, its pressure."""
        dt = 0.0 if self._last_time is None else now_s - self._last_time
        self._last_time = now_s
        sample = (dt, tokens, pressured)
        self._recent.append(sample)
        if self._open is None:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._after.append(sample)
        if len(self._after) < self.window:
            return None
        return self._close()

    @property
    def open(self) -> bool:
        return self._open is not None

    def _saturated(self) -> list[tuple[float, int, bool]]:
        """The longest run of the latest steps whose pressured share is saturated, from its
        first pressured step (the calm steps before a queue are not its baseline), if at
        least ``baseline`` long; else empty. The window a climb now is judged against."""
        recent, longest, pressured = list(self._recent), 0, 0
        for n, (_, _, p) in enumerate(reversed(recent), 1):
            pressured += p
            if pressured >= self.saturated_share * n:
                longest = n
        start = len(recent) - longest
        while start < len(recent) and not recent[start][2]:
            start += 1
        return recent[start:] if len(recent) - start >= self.baseline else []

    @property
    def ready(self) -> bool:
        """Whether a climb now could be judged: a saturated run of at least ``baseline``
        steps. A climb without that baseline would never get a verdict, and a loss would
        stay unseen."""
        before = measure(self._saturated())
        return before is not None and before.tokens_per_s > 0

    def begin(self) -> None:
        """A climb starts: the window before it is the saturated run up to now (a climb of
        several levels runs one change per level; the steps between them are not
        "before")."""
        self._open = None
        self._before = self._saturated()

    def climbed(self, from_level: int, to_level: int) -> bool:
        """A climb completed: open an audit if the window before it was saturated."""
        self._open = None
        recent = self._before if self._before is not None else self._saturated()
        self._before = None
        before = measure(recent)
        if before is None or before.tokens_per_s <= 0:
            return False
        self._open = (from_level, to_level, before)
        self._after, self._skip = [], self.settle
        return True

    def cancel(self) -> None:
        """The level moved again before the audit closed, or the climb failed."""
        self._open = None
        self._before = None

    def _close(self) -> Verdict | None:
        assert self._open is not None
        from_level, to_level, before = self._open
        self._open = None
        after = measure(self._after)
        if after is None or after.pressured_share < self.saturated_share:
            return None  # the load fell away: throughput no longer measures the level
        return Verdict(to_level, from_level, is_loss(before, after, self.tolerance), before, after)


class Backoff:
    """Levels not to climb into again until a step, the wait doubling per loss there."""

    def __init__(self, base_steps: int) -> None:
        self.base_steps = base_steps
        self.losses: dict[int, int] = {}
        self.until: dict[int, int] = {}

    def lost(self, level: int, step: int) -> int:
        """Record a loss at ``level``; returns the step it may be tried again."""
        self.losses[level] = self.losses.get(level, 0) + 1
        self.until[level] = step + self.base_steps * 2 ** (self.losses[level] - 1)
        return self.until[level]

    def paid(self, level: int) -> None:
        self.losses.pop(level, None)

    def blocked(self, level: int, step: int) -> bool:
        return step < self.until.get(level, -1)
