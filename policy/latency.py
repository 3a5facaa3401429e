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
Long prefill steps make t larger, so the same copies hide — the model sees that too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

from dynoff.policy.config import PolicyConfig


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A step's composition: tokens of decode requests and of prefill chunks."""

    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0

    @property
    def decode_only(self) -> bool:
        return self.num_prefill_tokens == 0


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
        for _ in range(3):
            start = now
            for layer in range(self.num_layers):
                now = max(now, ready.get(layer, 0.0)) + t
                partner = self._partner_to_fetch(layer, level, half)
                if partner is not None:
                    copy_free = max(now, copy_free) + x
                    ready[partner] = copy_free
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
    def from_k0_step(
        cls,
        num_layers: int,
        layer_bytes: int,
        h2d_bytes_per_s: float,
        k0_step_ms: float,
        overhead_fraction: float = 0.05,
        piecewise_penalty_ms: float = 0.0,
    ) -> OffloadCostModel:
        """Calibrate from a measured level-0 decode step: ``overhead_fraction`` of it is
        outside the layers, the rest splits evenly over the N layers."""
        return cls(
            num_layers,
            layer_bytes,
            h2d_bytes_per_s,
            layer_ms_base=k0_step_ms * (1 - overhead_fraction) / num_layers,
            overhead_ms=k0_step_ms * overhead_fraction,
            piecewise_penalty_ms=piecewise_penalty_ms,
        )

    def hidden_fraction(self, level: int, shape: StepShape) -> float:
        """Share of the level's copy time hidden behind compute (1.0 = fully hidden)."""
        if level == 0:
            return 1.0
        exposed = self.step_ms(level, shape) - self.step_ms(0, shape) - self.piecewise_penalty_ms
        return max(0.0, 1.0 - exposed / (2 * level * self.transfer_ms))


class LatencyEstimator:
    """Per-level L_k: measured decode-only averages, or the model refined by measurements.

    The model's refinement is one ratio, the mean of measured/predicted over every
    decode-only step seen, applied to levels not yet measured ``min_samples`` times.
    """

    def __init__(
        self,
        config: PolicyConfig,
        model: OffloadCostModel | None = None,
        calibrate: Callable[[float, StepShape], OffloadCostModel] | None = None,
    ) -> None:
        if config.estimator == "model" and model is None and calibrate is None:
            raise ValueError(
                "estimator='model' needs an OffloadCostModel or a way to calibrate one "
                "(layer count, layer bytes and H2D bandwidth)"
            )
        self.config = config
        self.model = model
        self._calibrate = calibrate
        self._sum: dict[int, float] = defaultdict(float)
        self._count: dict[int, int] = defaultdict(int)
        self._ratio_sum = 0.0
        self._ratio_count = 0
        self._last_decode_shape = StepShape(num_decode_tokens=1)

    def observe(self, level: int, forward_ms: float, shape: StepShape) -> None:
        """Record one step; steps with prefill are filtered out of the decode averages."""
        if not shape.decode_only or forward_ms <= 0:
            return
        self._sum[level] += forward_ms
        self._count[level] += 1
        self._last_decode_shape = shape
        if self.model is None and self._calibrate is not None and level == 0:
            if self._count[0] >= self.config.min_samples:
                self.model = self._calibrate(self._sum[0] / self._count[0], shape)
            return
        if self.model is not None:
            self._ratio_sum += forward_ms / self.model.step_ms(level, shape)
            self._ratio_count += 1

    def samples(self, level: int) -> int:
        return self._count[level]

    def measured(self, level: int) -> float | None:
        """Mean decode-only step time at ``level`` (ms), or None before any sample."""
        n = self._count[level]
        return self._sum[level] / n if n else None

    def predicted(self, level: int, shape: StepShape | None = None) -> float | None:
        """The model's L_k for ``shape`` (default: the last decode step's), refined."""
        if self.model is None:
            return None
        ratio = self._ratio_sum / self._ratio_count if self._ratio_count else 1.0
        return self.model.step_ms(level, shape or self._last_decode_shape) * ratio

    def estimate(self, level: int, shape: StepShape | None = None) -> float | None:
        """L_k as the configured estimator sees it (ms), or None when unknown.

        ``measured``: the decode-only mean. ``model``: the measured mean once a level has
        ``min_samples`` decode steps and ``shape`` is a decode step, else the refined model.
        """
        if self.config.estimator == "measured":
            return self.measured(level)
        decode = shape is None or shape.decode_only
        if decode and self._count[level] >= self.config.min_samples:
            return self.measured(level)
        return self.predicted(level, shape)

    def snapshot(self, max_level: int) -> dict[str, float | None]:
        """Current estimates of every level, for the trace."""
        return {str(k): self.estimate(k) for k in range(max_level + 1)}
