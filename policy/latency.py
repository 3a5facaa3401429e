"""Decode-latency estimators for the policy.

Two sources of L_k (the step time at offload depth k):

* **Measured** (the seed): the mean forward time of decode-only steps run at level k.
* **Model** (beyond the seed): :class:`OffloadCostModel` predicts L_k from what the worker
  measures — per-layer compute time, bytes per layer, the H2D bandwidth — so the policy needs
  no warm-up sweep; measured averages then refine it.

The model. Layers l = 0..N-1 run in order on the compute stream, each taking
``t = t_base + t_dec · n_decode + t_pre · n_prefill`` (ms). At depth k, layers i and i+N/2
(i < k) share one GPU region. One copy stream moves layers in at ``W`` bytes/s, one copy of
``B`` bytes taking ``x = B / W``:

* when layer i (i < k) finishes, the copy of layer i+N/2 is issued; layer i+N/2 waits for it;
* when layer i+N/2 finishes, the copy of layer i for the next step is issued.

Copies queue on the one stream: copy c starts at ``max(issue_c, end_{c-1})``; a layer
starts at ``max(end of previous layer, its copy's end)``. A step also pays ``overhead`` (ms,
embedding, LM head, sampling) and, when k > 0, ``piecewise_penalty`` (ms): k = 0 runs vLLM's
FULL decode CUDA graph, k > 0 the piecewise path (7.9 vs 16.2 ms on Qwen3-8B at batch 128).
:meth:`OffloadCostModel.step_ms` simulates three steps and returns the last (steady state).
When every copy hides (``x ≤ (N/2 - 1)·t`` and ``2k·x`` fits in the step),

    L_k = N·t + overhead + piecewise_penalty·[k > 0];

on a slow link with k = 1 it is copy-bound: ``L_1 = 2t + 2x + piecewise_penalty``
(e.g. Qwen3-32B on PCIe Gen5: t ≈ 0.45 ms, x = 0.975 GB / 55 GB/s = 17.7 ms).
Long prefill steps make t larger, so the same copies hide — the model sees that too. But a
level is held over every step that follows, so the policy prices it over the recent mix of
steps (:meth:`LatencyEstimator.predicted`), never over one step.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from dynoff.policy.config import PolicyConfig


class StepShape(NamedTuple):
    """A step's composition: tokens of decode requests and of prefill chunks, and the
    context the decode requests' attention reads (their KV, in tokens). A named tuple: the
    policy hashes thousands of them per step to price every level in reach.

    The context matters when a level is priced: the requests the extra KV admits bring
    their KV along, and on long contexts reading it is much of a decode step (a Qwen3-32B
    token of KV is 256 KiB: 60 requests at 3,000 tokens read 47 GB, ~10 ms of HBM a step).
    """

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_context_tokens: int = 0

    @property
    def decode_only(self) -> bool:
        return self.num_prefill_tokens == 0

    @classmethod
    def of(cls, scheduler_output: Any) -> StepShape:
        """The shape of the step vLLM's ``SchedulerOutput`` schedules, as the worker runs it:
        one-token requests decode, and their attention reads the tokens computed before the
        step (the new and cached request data carry that count). The worker reports it and
        the simulator prices it, so both read a step the same way."""
        scheduled = scheduler_output.num_scheduled_tokens
        decode = prefill = 0
        for num in scheduled.values():
            if num == 1:
                decode += 1
            else:
                prefill += num
        return cls(decode, prefill, sum(decode_contexts(scheduler_output).values()))


def decode_contexts(scheduler_output: Any) -> dict[str, int]:
    """The tokens each one-token (decoding) request of a ``SchedulerOutput`` has computed
    before the step, which its attention reads (the new and cached request data carry the
    count)."""
    scheduled = scheduler_output.num_scheduled_tokens
    contexts = {
        new.req_id: new.num_computed_tokens
        for new in scheduler_output.scheduled_new_reqs
        if scheduled.get(new.req_id) == 1
    }
    cached = scheduler_output.scheduled_cached_reqs
    contexts.update(
        (req_id, computed)
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        if scheduled.get(req_id) == 1
    )
    return contexts


def prefill_pairs(scheduler_output: Any) -> int:
    """The (query, key) pairs the step's prefill chunks attend: a chunk of ``n`` tokens after
    ``c`` computed ones reads ``n * c + n * (n + 1) / 2``. What a long prompt's later chunks
    cost beyond their tokens; recorded beside each timed step (``bench.serve_bench``'s
    ``forward_steps``) for the simulator's prefill price, not priced by the policy (a level
    does not change it)."""
    scheduled = scheduler_output.num_scheduled_tokens
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return sum(
        n * computed.get(req_id, 0) + n * (n + 1) // 2 for req_id, n in scheduled.items() if n > 1
    )


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A level-0 step's time as a function of its composition: ``intercept_ms +
    ms_per_decode_token · n_decode + ms_per_prefill_token · n_prefill + ms_per_context_token ·
    n_context``."""

    intercept_ms: float
    ms_per_decode_token: float = 0.0
    ms_per_prefill_token: float = 0.0
    ms_per_context_token: float = 0.0

    def step_ms(self, shape: StepShape) -> float:
        return (
            self.intercept_ms
            + self.ms_per_decode_token * shape.num_decode_tokens
            + self.ms_per_prefill_token * shape.num_prefill_tokens
            + self.ms_per_context_token * shape.num_context_tokens
        )


class StepTimeFit:
    """Least-squares fit of measured level-0 step times to the step's composition.

    The fit minimises *relative* error (each step weighted by 1 / ms²): step times span
    ~20 ms decode steps to ~900 ms chunked-prefill steps, and in absolute milliseconds the
    few long steps would set every slope, leaving the decode steps, most of the steps a level
    is held over, 40% off (Qwen3-32B long prompts on the H200).

    Keeps the sums of the normal equations only, so an observation costs O(1). :meth:`solve`
    tries the intercept with every subset of the three token counts (decode, prefill,
    context), largest first, and keeps the candidate with the smallest residual whose
    slopes are not negative and whose system is not singular (steps of one shape, ``n_decode
    + n_prefill`` always equal to the token budget, or no context measured, leave a count's
    slope undetermined: it is dropped, not guessed).
    """

    _CANDIDATES = ((0, 1, 2, 3), (0, 1, 3), (0, 1, 2), (0, 2, 3), (0, 1), (0, 2), (0, 3), (0,))
    _COLUMNS = 4

    def __init__(self) -> None:
        self.count = 0
        self._xtx = [[0.0] * self._COLUMNS for _ in range(self._COLUMNS)]
        self._xty = [0.0] * self._COLUMNS
        self._yty = 0.0
        self._rss: float | None = None  # of the last solve, in relative error squared

    def relative_rms(self) -> float | None:
        """Root-mean-square relative error of single steps against the last solved fit (the
        scatter the policy's climb margin is measured from), or None before a solve."""
        if self._rss is None or self.count < 2:
            return None
        return (max(self._rss, 0.0) / self.count) ** 0.5

    def observe(self, shape: StepShape, ms: float) -> None:
        if ms <= 0:
            return
        weight = 1.0 / (ms * ms)
        x = (
            1.0,
            float(shape.num_decode_tokens),
            float(shape.num_prefill_tokens),
            float(shape.num_context_tokens),
        )
        for i in range(self._COLUMNS):
            self._xty[i] += weight * x[i] * ms
            for j in range(self._COLUMNS):
                self._xtx[i][j] += weight * x[i] * x[j]
        self._yty += 1.0  # weight * ms * ms
        self.count += 1

    def solve(self) -> StepCost | None:
        best: tuple[float, list[float]] | None = None
        for columns in self._CANDIDATES:
            beta = _solve(
                [[self._xtx[i][j] for j in columns] for i in columns],
                [self._xty[i] for i in columns],
            )
            if beta is None or any(b < 0 for b in beta[1:]):
                continue
            # residual sum of squares: y'y - 2 b'X'y + b'X'X b
            fitted = sum(b * self._xty[i] for b, i in zip(beta, columns, strict=True))
            quad = sum(
                beta[a] * beta[b] * self._xtx[i][j]
                for a, i in enumerate(columns)
                for b, j in enumerate(columns)
            )
            rss = self._yty - 2 * fitted + quad
            if best is None or rss < best[0] - 1e-9 * abs(self._yty):
                coef = [0.0] * self._COLUMNS
                for b, i in zip(beta, columns, strict=True):
                    coef[i] = b
                best = (rss, coef)
        if best is None:
            return None
        self._rss = best[0]
        intercept, per_decode, per_prefill, per_context = best[1]
        return StepCost(max(intercept, 0.0), per_decode, per_prefill, per_context)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when ``a`` is (near) singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-10 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclasses.dataclass(frozen=True)
class OffloadCostModel:
    """Step time at each offload depth from per-layer compute and link bandwidth.

    Attributes:
        num_layers: N, decoder layers of equal size.
        layer_bytes: B, bytes of one layer's weights.
        h2d_bytes_per_s: W, measured pinned host-to-device bandwidth.
        layer_ms_base: per-layer compute time independent of batch (weight reads), ms.
        layer_ms_per_decode_token: per-layer ms added by each decode token.
        layer_ms_per_prefill_token: per-layer ms added by each prefill token.
        layer_ms_per_context_token: per-layer ms added by each token of KV a decode reads.
        overhead_ms: per-step time outside decoder layers, ms.
        piecewise_penalty_ms: extra per-step time of the piecewise path used while k > 0.
    """

    num_layers: int
    layer_bytes: int
    h2d_bytes_per_s: float
    layer_ms_base: float
    layer_ms_per_decode_token: float = 0.0
    layer_ms_per_prefill_token: float = 0.0
    overhead_ms: float = 0.0
    piecewise_penalty_ms: float = 0.0
    layer_ms_per_context_token: float = 0.0

    def __post_init__(self) -> None:
        if self.num_layers < 2:
            raise ValueError("the cost model needs at least 2 layers")
        if self.h2d_bytes_per_s <= 0:
            raise ValueError("h2d_bytes_per_s must be positive (measure it at start-up)")

    @property
    def transfer_ms(self) -> float:
        """x: one layer's H2D copy, ms."""
        return self.layer_bytes / self.h2d_bytes_per_s * 1e3

    def layer_ms(self, shape: StepShape) -> float:
        return (
            self.layer_ms_base
            + self.layer_ms_per_decode_token * shape.num_decode_tokens
            + self.layer_ms_per_prefill_token * shape.num_prefill_tokens
            + self.layer_ms_per_context_token * shape.num_context_tokens
        )

    def step_ms(self, level: int, shape: StepShape) -> float:
        """Predicted steady-state step time at depth ``level`` for a step of ``shape``."""
        half = self.num_layers // 2
        if not 0 <= level <= half:
            raise ValueError(f"level {level} outside [0, {half}]")
        t, x = self.layer_ms(shape), self.transfer_ms
        penalty = self.piecewise_penalty_ms if level > 0 else 0.0
        ready = {i: 0.0 for i in range(level)}  # first-half layers resident before step 0
        now = copy_free = 0.0
        duration = 0.0
        # Only layers 0..k-1 and N/2..N/2+k-1 wait for a copy or start one; the layers
        # between them run back to back (the step walks 2k layers, not N: this runs every
        # scheduler step for every level the policy prices).
        segments = ((0, half - level), (half, self.num_layers - half - level))
        for _ in range(3):
            start = now
            for first, plain in segments:
                for layer in range(first, first + level):
                    now = max(now, ready.get(layer, 0.0)) + t
                    partner = self._partner_to_fetch(layer, level, half)
                    assert partner is not None
                    copy_free = max(now, copy_free) + x
                    ready[partner] = copy_free
                now += plain * t
            now += self.overhead_ms + penalty
            duration = now - start
        return duration

    @staticmethod
    def _partner_to_fetch(layer: int, level: int, half: int) -> int | None:
        if layer < level:
            return layer + half
        if half <= layer < half + level:
            return layer - half
        return None

    @classmethod
    def from_step_cost(
        cls,
        num_layers: int,
        layer_bytes: int,
        h2d_bytes_per_s: float,
        cost: StepCost,
        overhead_fraction: float = 0.05,
        piecewise_penalty_ms: float = 0.0,
    ) -> OffloadCostModel:
        """Calibrate from a fitted level-0 step cost: ``overhead_fraction`` of the intercept
        is outside the layers; the rest, and every per-token cost, splits evenly over the N
        layers (a bigger batch lengthens every layer, which is what hides the copies)."""
        return cls(
            num_layers,
            layer_bytes,
            h2d_bytes_per_s,
            layer_ms_base=cost.intercept_ms * (1 - overhead_fraction) / num_layers,
            layer_ms_per_decode_token=cost.ms_per_decode_token / num_layers,
            layer_ms_per_prefill_token=cost.ms_per_prefill_token / num_layers,
            overhead_ms=cost.intercept_ms * overhead_fraction,
            piecewise_penalty_ms=piecewise_penalty_ms,
            layer_ms_per_context_token=cost.ms_per_context_token / num_layers,
        )

    def hidden_fraction(self, level: int, shape: StepShape) -> float:
        """Share of the level's copy time hidden behind compute (1.0 = fully hidden)."""
        if level == 0:
            return 1.0
        exposed = self.step_ms(level, shape) - self.step_ms(0, shape) - self.piecewise_penalty_ms
        return max(0.0, 1.0 - exposed / (2 * level * self.transfer_ms))


class LatencyEstimator:
    """Per-level L_k: measured decode-only averages, or the model refined by measurements.

    With a ``calibrate`` callback (the controller's) and no model up front, the model is
    built from a :class:`StepTimeFit` of every timed level-0 step, decode and prefill alike,
    once ``min_samples`` are in, and rebuilt every ``REFIT_EVERY`` level-0 steps: the layer
    time then grows with the batch as measured, so the model sees the copies hide behind a
    long step. Each level's refinement is the mean of measured / predicted over its own
    steps once it has ``min_samples``; a level with fewer borrows that of the highest level
    below it that has them (:meth:`ratio`).

    The model proxy prices a level over a *mix* of recent step compositions: its L_k is the
    mean predicted step time over them, i.e. how long the recent work would take at level
    k. A single long prefill step hides a level's copies; the decode steps around it do not.
    Predictions are cached per (level, shape) until the next refit.
    """

    REFIT_EVERY = 16
    CACHE_SIZE = 8192

    def __init__(
        self,
        config: PolicyConfig,
        model: OffloadCostModel | None = None,
        calibrate: Callable[[StepCost], OffloadCostModel] | None = None,
    ) -> None:
        if config.estimator == "model" and model is None and calibrate is None:
            raise ValueError(
                "estimator='model' needs an OffloadCostModel or a way to calibrate one "
                "(layer count, layer bytes and H2D bandwidth)"
            )
        self.config = config
        self.model = model
        self._calibrate = calibrate if model is None else None
        self.fit = StepTimeFit()
        self._sum: dict[int, float] = defaultdict(float)
        self._count: dict[int, int] = defaultdict(int)
        self._ratio_sum: dict[int, float] = defaultdict(float)
        self._ratio_count: dict[int, int] = defaultdict(int)
        self._last_decode_shape = StepShape(num_decode_tokens=1)
        self._step_ms: dict[tuple[int, StepShape], float] = {}

    def observe(self, level: int, forward_ms: float, shape: StepShape) -> None:
        """Record one timed step. Decode-only steps feed the per-level averages; every step
        feeds the model's refinement, and level-0 steps its fit."""
        if forward_ms <= 0:
            return
        model_ms = self._model_ms(level, shape) if self.model is not None else 0.0
        if model_ms > 0:  # a model fitted on a few fast steps can price a step at nothing
            self._ratio_sum[level] += forward_ms / model_ms
            self._ratio_count[level] += 1
        if level == 0 and self._calibrate is not None:
            self.fit.observe(shape, forward_ms)
            n = self.fit.count
            if n == self.config.min_samples or (
                n > self.config.min_samples and n % self.REFIT_EVERY == 0
            ):
                self._refit()
        if shape.decode_only:
            self._sum[level] += forward_ms
            self._count[level] += 1
            self._last_decode_shape = shape

    def recalibrate(self) -> None:
        """The link figures changed (the workers' calibration): rebuild the model from the
        fit so far."""
        if self._calibrate is not None and self.fit.count >= self.config.min_samples:
            self._refit()

    def _refit(self) -> None:
        assert self._calibrate is not None
        cost = self.fit.solve()
        if cost is None:
            return
        self.model = self._calibrate(cost)
        # Ratios against the old model, and its predictions, no longer describe the new one.
        self._ratio_sum.clear()
        self._ratio_count.clear()
        self._step_ms.clear()

    def _model_ms(self, level: int, shape: StepShape) -> float:
        """The (unrefined) model's step time, cached: the simulation walks every layer."""
        assert self.model is not None
        key = (level, shape)
        ms = self._step_ms.get(key)
        if ms is None:
            if len(self._step_ms) >= self.CACHE_SIZE:
                self._step_ms.clear()
            ms = self._step_ms[key] = self.model.step_ms(level, shape)
        return ms

    def samples(self, level: int) -> int:
        return self._count[level]

    def refined(self, level: int) -> bool:
        """The level's own measurements refine the model (else it borrows a ratio)."""
        return self._ratio_count[level] >= self.config.min_samples

    def measured(self, level: int) -> float | None:
        """Mean decode-only step time at ``level`` (ms), or None before any sample."""
        n = self._count[level]
        return self._sum[level] / n if n else None

    def ratio(self, level: int) -> float:
        """Measured / predicted for ``level``: its own once it has ``min_samples`` steps,
        else that of the highest level below it that has them, else the offloading levels'
        pooled, else level 0's, else 1.

        A level borrows from below, never from a pool that mixes levels: the model's error
        grows with the copies a level exposes, and a pool weighted towards a long-held lower
        level priced level 6 of Qwen3-32B on 392 GB/s 2.4% *faster* than the measured level
        5 beneath it, on the same steps (the simulator, bursty long outputs): the policy
        climbed into a loss that took minutes to drain."""
        need = self.config.min_samples
        if self._ratio_count[level] >= need:
            return self._ratio_sum[level] / self._ratio_count[level]
        below = [k for k in self._ratio_count if k < level and self._ratio_count[k] >= need]
        if below:
            k = max(below)
            return self._ratio_sum[k] / self._ratio_count[k]
        for levels in ([k for k in self._ratio_count if k > 0], [0]):
            count = sum(self._ratio_count[k] for k in levels)
            if count:
                return sum(self._ratio_sum[k] for k in levels) / count
        return 1.0

    def predicted(self, level: int, mix: Sequence[StepShape] = ()) -> float | None:
        """The model's mean L_k over the steps of ``mix`` (default: the last decode step),
        refined."""
        if self.model is None:
            return None
        shapes = mix or (self._last_decode_shape,)
        mean = sum(self._model_ms(level, shape) for shape in shapes) / len(shapes)
        return mean * self.ratio(level)

    def estimate(self, level: int, mix: Sequence[StepShape] = ()) -> float | None:
        """L_k as the configured estimator sees it (ms), or None when unknown.

        ``measured``: the decode-only mean. ``model``: for a given ``mix`` of step shapes
        (the model proxy), the refined model's mean over that mix at every level, so that
        levels are compared on the same work; without one (the decode proxy), the
        decode-only mean once the level has ``min_samples`` steps, else the refined model.
        """
        if self.config.estimator == "measured":
            return self.measured(level)
        if not mix and self._count[level] >= self.config.min_samples:
            return self.measured(level)
        return self.predicted(level, mix)

    def snapshot(
        self, levels: Iterable[int], mix: Sequence[StepShape] = ()
    ) -> dict[str, float | None]:
        """Current estimates of ``levels`` over ``mix``, for the trace."""
        return {str(k): self.estimate(k, mix) for k in levels}
