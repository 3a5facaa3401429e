"""Prometheus metrics on ``vllm serve``'s ``/metrics``: a stat-logger plugin
(``vllm.stat_logger_plugins``, loaded by vLLM in the API server process).

vLLM calls :meth:`DynamicOffloadStatLogger.record` with each engine step's
``SchedulerStats``; the plugin's own state comes from the status board the scheduler
publishes (:mod:`.status`, which says why it cannot ride in ``SchedulerStats``), read at
most every :attr:`~DynamicOffloadStatLogger.READ_EVERY_S`. Names and labels follow vLLM's
(``vllm:`` prefix, ``model_name`` and ``engine`` labels):

=========================================== ========= ==========================================
``vllm:dynoff_offload_level``               gauge     the level every worker runs at
``vllm:dynoff_offload_target_level``        gauge     the level the policy (or operator) wants
``vllm:dynoff_max_offload_level``           gauge     the highest level allowed now (cap)
``vllm:dynoff_kv_capacity_blocks``          gauge     KV blocks in circulation
``vllm:dynoff_kv_capacity_tokens``          gauge     the same, in tokens
``vllm:dynoff_level_changes_total``         counter   completed changes, ``direction`` up/down
``vllm:dynoff_resize_failures_total``       counter   changes that failed and were rolled back
``vllm:dynoff_drain_aborts_total``          counter   lowerings abandoned before they drained
``vllm:dynoff_level_change_stall_seconds``  histogram engine stall of each change, by direction
``vllm:dynoff_draining_groups``             gauge     KV groups draining for a lowering (0: none)
``vllm:dynoff_kv_blocks_being_stored``      gauge     free KV blocks a copy to vLLM's CPU KV tier
                                                      still reads (a drain waits for them); only
                                                      with ``--kv-offloading-size``
``vllm:dynoff_policy_decision``             gauge     1 for the last decision's ``reason``
=========================================== ========= ==========================================

The metrics are created at the first ``record`` (vLLM's Prometheus logger, built after the
plugins, unregisters every ``vllm:`` collector when it starts). On a server without dynamic
offloading (no ``additional_config.dynamic_offload``) the logger does nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase

from dynoff.policy.config import DynamicOffloadConfig
from dynoff.policy.status import board_dir, read_status

# Level changes stall the engine for milliseconds (packed layout) to ~170 ms (per-layer).
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
DECISIONS = (
    "hold",
    "hold-calm",
    "cooldown",
    "up",
    "down",
    "down-pressure",
    "down-loss",
    "forced",
    "pinned",
    "warmup",
    "warmup-done",
)


class _Metrics:
    """The collectors (one set per process, labelled per engine)."""

    def __init__(self) -> None:
        names = ["model_name", "engine"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*names, *extra], multiprocess_mode="mostrecent")

        self.level = gauge("vllm:dynoff_offload_level", "Offload level the workers run at.")
        self.target = gauge(
            "vllm:dynoff_offload_target_level", "Offload level the policy or operator wants."
        )
        self.max_level = gauge(
            "vllm:dynoff_max_offload_level", "Highest offload level allowed (operator cap)."
        )
        self.blocks = gauge("vllm:dynoff_kv_capacity_blocks", "KV cache blocks in circulation.")
        self.tokens = gauge("vllm:dynoff_kv_capacity_tokens", "KV cache capacity in tokens.")
        self.draining = gauge(
            "vllm:dynoff_draining_groups", "KV block groups draining for a lowering (0: none)."
        )
        self.being_stored = gauge(
            "vllm:dynoff_kv_blocks_being_stored",
            "Free KV blocks a copy to the CPU KV tier still reads (a drain waits for them).",
        )
        self.decision = gauge(
            "vllm:dynoff_policy_decision",
            "1 for the reason of the policy's last decision.",
            ("reason",),
        )
        self.changes = Counter(
            "vllm:dynoff_level_changes", "Completed offload level changes.", [*names, "direction"]
        )
        self.failures = Counter(
            "vllm:dynoff_resize_failures", "Level changes that failed and were rolled back.", names
        )
        self.aborts = Counter(
            "vllm:dynoff_drain_aborts", "Lowerings abandoned before their KV drained.", names
        )
        self.stall = Histogram(
            "vllm:dynoff_level_change_stall_seconds",
            "Engine stall of each offload level change.",
            [*names, "direction"],
            buckets=STALL_BUCKETS,
        )

    def registered(self) -> bool:
        return self.level in REGISTRY._collector_to_names


_METRICS: _Metrics | None = None


def _metrics() -> _Metrics:
    """The process's collectors, made again if a vLLM Prometheus logger started since
    unregistered them (it drops every ``vllm:`` collector)."""
    global _METRICS
    if _METRICS is None or not _METRICS.registered():
        for collector in list(REGISTRY._collector_to_names):
            if getattr(collector, "_name", "").startswith("vllm:dynoff_"):
                REGISTRY.unregister(collector)
        _METRICS = _Metrics()
    return _METRICS


class DynamicOffloadStatLogger(StatLoggerBase):
    READ_EVERY_S = 0.5

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        extra = vllm_config.additional_config
        self.enabled = isinstance(extra, dict) and DynamicOffloadConfig.KEY in extra
        self.directory: Path | None = None
        if self.enabled:
            self.directory = board_dir(vllm_config.instance_id)
        model_name = vllm_config.model_config.served_model_name if vllm_config.model_config else ""
        self._labels = {"model_name": str(model_name), "engine": str(engine_index)}
        self._read_at: float | None = None
        self._seen: dict[str, Any] = {}

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if not self.enabled or self.directory is None:
            return
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at < self.READ_EVERY_S:
            return
        self._read_at = now
        status = read_status(self.directory)
        if status is not None:
            self.update(status)

    def update(self, status: dict[str, Any]) -> None:
        """Set the metrics from one published status."""
        m, labels = _metrics(), self._labels
        m.level.labels(**labels).set(status["level"])
        m.target.labels(**labels).set(status["target"])
        cap = status.get("cap")
        m.max_level.labels(**labels).set(status["max_level"] if cap is None else cap)
        m.blocks.labels(**labels).set(status["capacity_blocks"])
        m.tokens.labels(**labels).set(status["capacity_tokens"])
        m.draining.labels(**labels).set(status.get("draining_groups", 0))
        if status.get("blocks_being_stored") is not None:  # a CPU KV tier is on
            m.being_stored.labels(**labels).set(status["blocks_being_stored"])
        reason = status.get("decision")
        for name in DECISIONS:
            m.decision.labels(**labels, reason=name).set(1 if name == reason else 0)
        for direction, total in status["changes"].items():
            counter = m.changes.labels(**labels, direction=direction)
            self._count(counter, f"changes_{direction}", total)
        self._count(m.failures.labels(**labels), "failures", status["resize_failures"])
        self._count(m.aborts.labels(**labels), "aborts", status["drain_aborts"])
        last = self._seen.get("stall_seq", 0)
        for seq, direction, stall_ms in status.get("stalls", ()):
            if seq > last:
                m.stall.labels(**labels, direction=direction).observe(stall_ms / 1e3)
                self._seen["stall_seq"] = seq

    def _count(self, counter: Any, key: str, total: int) -> None:
        """Counters follow the board's running totals."""
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

    def log_engine_initialized(self) -> None:
        pass
