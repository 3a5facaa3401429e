"""The scheduler's offload controller: policy + elastic pool + the command protocol.

Kept apart from the vLLM scheduler class so it can be driven step by step in tests. Per
step the scheduler calls, in order::

    command = controller.on_schedule_start(step, waiting, running)   # before allocation
    ... vLLM schedules (allocates blocks) ...
    controller.on_schedule_end()                                      # abort a starving drain
    ... the command rides on SchedulerOutput to every worker ...
    controller.on_report(report)                                      # acks, latencies

With the ``priced`` rule the controller also prices level changes (the stall each measured
change cost, :class:`~dynoff.policy.pricing.SwitchCost`), audits every climb by the tokens
per second served before and after it (:class:`~dynoff.policy.audit.ChangeAudit`), and
takes the link bandwidth and piecewise penalty from the workers' start-up calibration
(:class:`~dynoff.policy.messages.Calibration`, on the first report) unless the
configuration sets them.

Level changes move one level per command. Raising k: the command carries the tier's groups
to map (the workers alias the partner layer and map the freed pages); their blocks become
allocatable only once every rank acknowledges (two-phase). Lowering k: the tier drains
first (no scheduling ever waits); once its groups are free and ``drain_lag_steps`` steps
have passed, the command carries them to unmap. A failed resize leaves pool and level as
they were, and serving continues.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from dynoff.policy.algorithm import Decision, OffloadPolicy, Pressure
from dynoff.policy.audit import ChangeAudit, Verdict
from dynoff.policy.block_pool import ElasticBlockPool
from dynoff.policy.config import DynamicOffloadConfig
from dynoff.policy.geometry import CapacityPlan, KVLayout, check_worker_plans
from dynoff.policy.latency import LatencyEstimator, OffloadCostModel, StepCost, StepShape
from dynoff.policy.messages import (
    Calibration,
    OffloadCommand,
    PlanReport,
    ResizeOutcome,
    StepReport,
)
from dynoff.policy.pricing import RequestLifetimes, model_error
from dynoff.policy.status import control_error
from dynoff.policy.trace import TraceWriter, trace_range

logger = logging.getLogger("vllm.dynoff.policy")

# Until the workers' calibration arrives (or if it failed): the H200's PCIe Gen5 figures.
FALLBACK_H2D_GBPS = 53.0
FALLBACK_PIECEWISE_PENALTY_MS = 0.0
# A step's context in the policy's step shapes: to the nearest 1,000 tokens (the shapes key
# the model's cache of predictions; a Qwen3-32B step reads 1,000 tokens of KV in ~0.05 ms).
CONTEXT_ROUNDING = 3


class LevelsDisagreeError(RuntimeError):
    """A worker serves at another level than the scheduler's while no change is in flight:
    blocks would be handed out on pages no worker maps, or kept on pages the workers took
    back. Serving stops with this error."""


class OffloadController:
    def __init__(
        self,
        config: DynamicOffloadConfig,
        plan: CapacityPlan,
        layout: KVLayout,
        block_pool: BlockPool,
        num_ranks: int = 1,
        model: OffloadCostModel | None = None,
        num_layers: int | None = None,
        layer_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        expected_plan: PlanReport | None = None,
        max_running: int | None = None,
        kv_connector_reads: Callable[[], Collection[int]] | None = None,
        kv_connector_holds: Callable[[KVCacheBlock], bool] | None = None,
    ) -> None:
        self.config = config
        self.max_running = max_running  # vLLM's max_num_seqs: the batch cannot grow past it
        self.expected_plan = expected_plan  # checked against the workers' first report
        self.clock = clock  # seconds: the audit's step times and the trace's
        self.plan = plan
        self.num_ranks = num_ranks
        self.elastic = ElasticBlockPool(
            block_pool,
            layout,
            plan.groups_at(0),
            config.policy.drain_lag_steps,
            reads=kv_connector_reads,
            held_below=kv_connector_holds,
        )
        self.h2d_GBps = config.h2d_GBps or FALLBACK_H2D_GBPS
        self.piecewise_penalty_ms = (
            FALLBACK_PIECEWISE_PENALTY_MS
            if config.piecewise_penalty_ms is None
            else config.piecewise_penalty_ms
        )
        self.calibration: Calibration | None = None
        self._calibrate: Callable[[StepCost], OffloadCostModel] | None = None
        calibrate = None
        if num_layers is not None and layer_bytes is not None:

            def calibrate(cost: StepCost) -> OffloadCostModel:
                return OffloadCostModel.from_step_cost(
                    num_layers,
                    layer_bytes,
                    self.h2d_GBps * 1e9,
                    cost,
                    piecewise_penalty_ms=self.piecewise_penalty_ms,
                )

        self._calibrate = calibrate
        self.estimator = LatencyEstimator(config.policy, model, calibrate)
        self.policy = OffloadPolicy(
            config.policy, plan.max_level, plan.capacity_blocks, self.estimator
        )
        self.trace = TraceWriter(config.trace_path, clock)
        self.level = 0  # the level every worker runs at
        self.inflight: OffloadCommand | None = None
        self._outcomes: dict[int, ResizeOutcome] = {}
        self._errors: list[str] = []
        self._ran_at: int | None = None  # rank 0's level once it processed the inflight command
        self._next_id = 0
        self._mix: deque[StepShape] = deque(maxlen=config.policy.mix_steps)
        self.lifetimes = RequestLifetimes()  # how long a level's blocks stay held
        self._decision = "hold"
        self._last: Decision | None = None
        self._climb_from: int | None = None  # where a climb of several levels began
        # The operator's controls (the status endpoint): a pinned level, a cap on the level.
        self.pin: int | None = None
        self.cap: int | None = None
        self.control_applied = 0  # the number of the last control request applied
        self.control_error: str | None = None
        self._levels: list[dict[str, Any]] = []  # the status's table of levels, and when
        self._levels_at: float | None = None
        self._hold_drain = False  # the descent under way was decided under pressure
        policy = config.policy
        self.audit = (
            ChangeAudit(
                policy.audit_window_steps,
                policy.audit_settle_steps,
                policy.audit_tolerance,
                baseline=policy.audit_baseline,
            )
            if policy.rule == "priced"
            else None
        )
        self._pressured = False

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Seconds from ``clock`` from now on, for the audit and the trace (the simulator's
        simulated time; the trace's times restart at 0)."""
        self.clock = clock
        self.trace.restart_clock(clock)

    # -- per step -----------------------------------------------------------------------------
    def on_schedule_start(
        self, step: int, waiting: int, running: int, demand_blocks: int | None = None
    ) -> OffloadCommand | None:
        """``waiting``: requests the last schedule left waiting; ``demand_blocks``: the KV
        blocks they need (None: unknown, the price of a level is not bounded by it)."""
        self.elastic.poll(step)
        if self.elastic.should_abort():
            self._abort_drain(step)
        elif self.elastic.overdue(step, self.config.policy.drain_timeout_steps):
            self._abort_drain(step, "timed out")
        policy = self.config.policy
        self._pressured = waiting > 0 or self.elastic.pool.get_usage() > policy.high_threshold
        command = None
        if self.inflight is not None:
            self._settle_overdue(step)
        if self.inflight is None:
            ready = self.elastic.take_ready(step)
            if ready:
                command = self._issue(step, self.level - 1, unmap=ready)
            elif not self.elastic.draining:
                with trace_range("dynoff.policy.decide"):
                    command = self._maybe_move(step, waiting, running, demand_blocks)
        self._record(step, waiting, running)
        return command

    def on_requests(self, step: int, started: Iterable[str], finished: Iterable[str]) -> None:
        """The requests a schedule started and those it reports finished since the last
        (vLLM's ``SchedulerOutput``): their lifetimes price a climb's exit."""
        for request_id in started:
            self.lifetimes.started(request_id, step)
        for request_id in finished:
            self.lifetimes.finished(request_id, step)

    def on_schedule_end(self, step: int, tokens: int = 0) -> None:
        """After vLLM's schedule: ``tokens`` it served this step (for the audit)."""
        if self.elastic.should_abort():
            self._abort_drain(step)
        if self.audit is not None:
            verdict = self.audit.observe(self.clock(), tokens, self._pressured)
            if verdict is not None:
                self._judge(step, verdict)

    def _judge(self, step: int, verdict: Verdict) -> None:
        self.trace.event(
            "audit",
            step=step,
            level=verdict.level,
            from_level=verdict.from_level,
            loss=verdict.loss,
            tokens_per_s_before=round(verdict.before.tokens_per_s, 1),
            tokens_per_s_after=round(verdict.after.tokens_per_s, 1),
        )
        if not verdict.loss:
            self.policy.paid(verdict.level)
            return
        retry = self.policy.lost(verdict.level, step, verdict.from_level)
        logger.info(
            "dynamic offload: level %d served %.0f tokens/s against %.0f at level %d before "
            "the climb (%.1f%%): a loss; going back, and not climbing above level %d before "
            "step %d",
            verdict.level,
            verdict.after.tokens_per_s,
            verdict.before.tokens_per_s,
            verdict.from_level,
            (verdict.ratio - 1) * 100,
            verdict.from_level,
            retry,
        )

    def _use_calibration(self, cal: Calibration) -> None:
        """The workers measured this machine: price with it, except what the user set."""
        self.calibration = cal
        if self.config.h2d_GBps is None and cal.h2d_GBps > 0:
            self.h2d_GBps = cal.h2d_GBps
        if self.config.piecewise_penalty_ms is None:
            self.piecewise_penalty_ms = cal.piecewise_penalty_ms
        self.policy.switch.calibrate(cal.stall_up_ms, cal.stall_down_ms, cal.lock_ms)
        if self._calibrate is not None:
            self.policy.unmeasured_margin = model_error(cal, self._calibrate)
        self.estimator.recalibrate()
        self.trace.event(
            "calibration",
            h2d_GBps=round(cal.h2d_GBps, 2),
            layer_copy_ms=round(cal.layer_copy_ms, 3),
            piecewise_penalty_ms=round(cal.piecewise_penalty_ms, 3),
            decode_steps=[list(row) for row in cal.decode_steps],
            stall_up_ms=round(cal.stall_up_ms, 2),
            stall_down_ms=round(cal.stall_down_ms, 2),
            lock_ms=round(cal.lock_ms, 2),
            priced_h2d_GBps=round(self.h2d_GBps, 2),
            priced_piecewise_penalty_ms=round(self.piecewise_penalty_ms, 3),
            unmeasured_margin=round(self.policy.unmeasured_margin, 4),
        )
        logger.info(
            "dynamic offload: pricing levels with %.1f GB/s, a %.2f ms piecewise penalty, "
            "%.0f/%.0f ms per change up/down%s; a climb into an unmeasured level must clear "
            "%.1f%% (the model's error on level 1 here)",
            self.h2d_GBps,
            self.piecewise_penalty_ms,
            cal.stall_up_ms,
            cal.stall_down_ms,
            f" and {cal.lock_ms:.0f} ms a level's first entry" if cal.lock_ms else "",
            self.policy.unmeasured_margin * 100,
        )

    def _check_plans(self, plans: tuple[PlanReport, ...]) -> None:
        """Every rank maps the plan the pool hands blocks out by, or serving stops here
        (:class:`~dynoff.policy.geometry.PlanMismatchError`)."""
        if self.expected_plan is None:
            return
        check_worker_plans(self.expected_plan, plans)
        self.trace.event(
            "plan_checked",
            ranks=len(plans),
            real_layer_pages=min(p.real_layer_pages for p in plans),
        )
        logger.info(
            "dynamic offload: %d rank(s) map the scheduler's KV plan (%d blocks, groups of %d)",
            len(plans),
            self.expected_plan.num_blocks,
            self.expected_plan.group_blocks,
        )

    def on_report(self, report: StepReport) -> None:
        if report.plans:
            self._check_plans(report.plans)
        if self.inflight is None and report.level_now not in (None, self.level):
            # On the H100 (2026-12-06) a torn calibration left the workers at level 1 while
            # the scheduler served level 0 for a whole run, unseen; any such split stops here.
            raise LevelsDisagreeError(
                f"dynamic offload: the workers are at level {report.level_now} and the "
                f"scheduler at level {self.level}, with no change in flight (step "
                f"{report.step}): the KV blocks handed out would not match the pages mapped. "
                'Restart the server; if it recurs, set "policy": {"max_level": 0} and report it'
            )
        if report.calibration is not None:
            self._use_calibration(report.calibration)
        if report.timed:
            shape = StepShape(
                report.num_decode_tokens,
                report.num_prefill_tokens,
                round(report.num_context_tokens, -CONTEXT_ROUNDING),
            )
            self._mix.append(shape)
            self.estimator.observe(report.level, report.forward_ms, shape)
            self.trace.forward(
                step=report.step,
                level=report.level,
                forward_ms=round(report.forward_ms, 4),
                decode_tokens=report.num_decode_tokens,
                prefill_tokens=report.num_prefill_tokens,
                context_tokens=report.num_context_tokens,
                **({"prefill_pairs": report.prefill_pairs} if report.prefill_pairs else {}),
            )
        if self.inflight is not None and report.last_command >= self.inflight.command_id:
            self._ran_at = report.level_now
        for outcome in report.outcomes:
            if self.inflight is None or outcome.command_id != self.inflight.command_id:
                continue
            self._outcomes[outcome.rank] = outcome
            if not outcome.ok:
                self._errors.append(f"rank {outcome.rank}: {outcome.error}")
        if self.inflight is not None and len(self._outcomes) >= self.num_ranks:
            self._complete(report.step)
        # After the outcomes: a lowering's restore wait, often reported together with the
        # change itself (the device passed the restored layer before the report was built),
        # follows it in the trace, so each wait is read as the change's that caused it.
        if report.restore_wait_ms > 0:
            self.trace.event(
                "restore_wait", step=report.step, wait_ms=round(report.restore_wait_ms, 3)
            )
        if report.link_GBps is not None:  # the fast-link emulation, as it served
            self.trace.event("link", step=report.step, GBps=round(report.link_GBps, 1))

    # -- decisions ----------------------------------------------------------------------------
    def _maybe_move(
        self, step: int, waiting: int, running: int, demand_blocks: int | None
    ) -> OffloadCommand | None:
        forced = self.config.forced_level(step)
        if forced is None and self.pin is not None:
            forced, self._decision = self.pin, "pinned"
        elif forced is not None:
            self._decision = "forced"
        if forced is not None:
            target = min(forced, self.policy.max_level)
            self.policy.level = target
        else:
            usage = self.elastic.pool.get_usage()
            auditing = self.audit is not None and self.audit.open
            # Read only under pressure, where a climb is priced (a pass over the window).
            auditable = self.audit is None or not self._pressured or self.audit.ready
            room = self.max_running / max(running, 1) if self.max_running else None
            pressure = Pressure(
                waiting,
                usage,
                tuple(self._mix),
                step,
                auditing,
                auditable,
                demand_blocks,
                room,
                self.lifetimes.exit_steps(),
            )
            decision = self.policy.decide(pressure)
            target, self._decision, self._last = decision.level, decision.reason, decision
        if target > self.level:
            if self._climb_from is None:  # a climb begins: the audit's window before it
                self._climb_from = self.level
                if self.audit is not None:
                    self.audit.begin()
            groups = self.elastic.begin_grow(self.plan.tier(self.level))
            return self._issue(step, self.level + 1, map_=groups)
        if target < self.level:
            operator = self._decision == "pinned" or self.level > self.policy.max_level
            if operator or self._decision in ("down", "down-pressure", "down-loss", "forced"):
                # A new descent (not the rest of one): held (never aborted for want of free
                # blocks) if decided under pressure or by the operator.
                self._hold_drain = operator or self._decision in ("down-pressure", "down-loss")
            if self._decision == "down-pressure":
                logger.info(
                    "dynamic offload: level %d costs more time than its KV saves under "
                    "pressure; draining to level %d",
                    self.level,
                    target,
                )
            self.elastic.begin_shrink(self.plan.tier(self.level - 1), step, hold=self._hold_drain)
            ready = self.elastic.take_ready(step)
            if ready:
                return self._issue(step, self.level - 1, unmap=ready)
        return None

    def _issue(
        self, step: int, level: int, map_: tuple[int, ...] = (), unmap: tuple[int, ...] = ()
    ) -> OffloadCommand:
        command = OffloadCommand(
            command_id=self._next_id,
            step=step,
            target_level=level,
            map_groups=map_,
            unmap_groups=unmap,
            safe_after_step=step - 1,
        )
        self._next_id += 1
        self.inflight, self._outcomes, self._errors = command, {}, []
        self._ran_at = None
        return command

    def _settle_overdue(self, step: int) -> None:
        """A command still missing outcomes ``report_timeout_steps`` after it was issued
        (a lost report) is settled by the level rank 0 reports once it has processed the
        command (``StepReport.last_command`` / ``level_now``): the ranks agree on the level
        before every forward (:mod:`~dynoff.compile_pass.levels`), so that level says
        whether the change happened. Until such a report comes the command stays open:
        guessing would hand out blocks on pages nobody mapped, or keep blocks whose pages
        were unmapped."""
        command = self.inflight
        assert command is not None
        if step - command.step <= self.config.policy.report_timeout_steps:
            return
        if self._ran_at not in (command.target_level, self.level):
            return
        missing = [r for r in range(self.num_ranks) if r not in self._outcomes]
        applied = self._ran_at == command.target_level
        self.trace.event(
            "report_lost",
            step=step,
            command_id=command.command_id,
            ranks=missing,
            applied=applied,
        )
        logger.warning(
            "dynamic offload: no outcome of command %d from rank(s) %s within %d steps; the "
            "workers are at level %d since, so it is settled as %s",
            command.command_id,
            missing,
            self.config.policy.report_timeout_steps,
            self._ran_at,
            "applied" if applied else "failed",
        )
        for rank in missing:
            lost = f"no outcome within {self.config.policy.report_timeout_steps} steps"
            self._outcomes[rank] = ResizeOutcome(command.command_id, rank, applied, lost)
            if not applied:
                self._errors.append(f"rank {rank}: {lost}")
        self._complete(step)

    def _complete(self, step: int) -> None:
        command, self.inflight = self.inflight, None
        assert command is not None
        outcomes = list(self._outcomes.values())
        if all(o.ok for o in outcomes):
            self.elastic.commit_grow(command.map_groups)
            self.elastic.commit_shrink(command.unmap_groups)
            slowest = max(outcomes, key=lambda o: o.remap_ms)  # the rank everyone waited for
            direction = 1 if command.target_level > self.level else -1
            self.policy.switch.observe(direction, slowest.remap_ms)
            self.policy.switch.entered(command.target_level)
            arrived = direction > 0 and command.target_level >= self.policy.level
            if self.audit is not None:
                if arrived:  # the whole climb, from where it began, is audited as one
                    origin = self.level if self._climb_from is None else self._climb_from
                    self.audit.climbed(origin, command.target_level)
                elif direction < 0:
                    self.audit.cancel()
            if arrived or direction < 0:
                self._climb_from = None
            self.trace.event(
                "level_change",
                step=step,
                from_level=self.level,
                to_level=command.target_level,
                capacity_blocks=self.plan.capacity_blocks(command.target_level),
                remap_ms=round(slowest.remap_ms, 3),
                stall_ms=round(max(o.stall_ms for o in outcomes), 3),
                sync_ms=round(slowest.sync_ms, 3),
                driver_ms=round(slowest.driver_ms, 3),
                copy_ms=round(slowest.copy_ms, 3),
                slots_changed=slowest.slots_changed,
                ranks=len(outcomes),
                **self._audit_findings(outcomes),
            )
            logger.info(
                "dynamic offload: level %d -> %d (KV capacity %d blocks)",
                self.level,
                command.target_level,
                self.elastic.capacity_blocks,
            )
            self.level = command.target_level
        else:
            self.elastic.abort_grow(command.map_groups)
            self.elastic.abort_shrink(command.unmap_groups)
            self.policy.revert(self.level)
            self._climb_from = None
            if self.audit is not None:
                self.audit.cancel()
            self.trace.event(
                "resize_failed",
                step=step,
                command_id=command.command_id,
                level=self.level,
                errors=self._errors,
            )
            logger.warning(
                "dynamic offload: resize to level %d failed, serving on at level %d: %s",
                command.target_level,
                self.level,
                "; ".join(self._errors),
            )

    @staticmethod
    def _audit_findings(outcomes: list[ResizeOutcome]) -> dict[str, list[str]]:
        """With ``audit_changes``: what each rank's change altered that it must not (none:
        no field)."""
        found = [f"rank {o.rank}: {what}" for o in outcomes for what in o.audit]
        return {"audit": found} if found else {}

    def _abort_drain(self, step: int, why: str = "ran dry") -> None:
        started = self.elastic.drain_started_step
        started = step if started is None else started
        targets = self.elastic.abort_drain()
        self.policy.revert(self.level)
        self.trace.event(
            "drain_aborted", step=step, groups=list(targets), level=self.level, why=why
        )
        logger.info(
            "dynamic offload: drain of %d groups to level %d aborted after %d steps (%s); "
            "serving on at level %d",
            len(targets),
            self.level - 1,
            step - started,
            "the KV free list ran dry" if why == "ran dry" else why,
            self.level,
        )

    # -- the operator ---------------------------------------------------------------------------
    def operate(self, seq: int, pin: int | None, cap: int | None) -> None:
        """An operator's request (the status endpoint): serve at ``pin`` (None: the policy
        decides) with no level above ``cap`` (None: the plan's maximum). A request outside
        the plan is refused (``control_error``) and changes nothing. Takes effect at the next
        decision; a level above the cap drains like any lowering."""
        top = self.plan.max_level
        error = control_error(pin, cap, top)
        self.control_applied, self.control_error = seq, error
        if error is not None:
            logger.warning("dynamic offload: operator request %d refused: %s", seq, error)
            self.trace.live.dirty = True
            return
        unpinned = self.pin is not None and pin is None
        self.pin, self.cap = pin, cap
        self.policy.max_level = top if cap is None else cap
        if unpinned or self.policy.level > self.policy.max_level:
            # The policy decides again from where the workers are, within the cap.
            self.policy.level = min(self.level, self.policy.max_level)
            self.policy.cooldown = 0
        self.trace.event("operator", seq=seq, pin=pin, cap=cap)
        logger.info(
            "dynamic offload: operator request %d: %s, levels up to %d",
            seq,
            "policy decides" if pin is None else f"pinned at level {pin}",
            self.policy.max_level,
        )

    LEVELS_EVERY_S = 5.0  # how often the status recomputes L_k at every level

    def status(self, block_size: int) -> dict[str, Any]:
        """The state the status board publishes: the trace's live view, the plan, the
        operator's controls, and C_k and L_k at every level: L_k is the decode step at the
        last decode batch (measured once the level has ``min_samples`` steps, else the
        model's), recomputed every :attr:`LEVELS_EVERY_S` (the model walks every layer per
        level; over the whole step mix, at every level, it would cost the engine loop tens
        of milliseconds). What the last decision weighed is in ``proxy``, ``proxy_next``,
        ``priced_level`` and ``margin``."""
        now = self.clock()
        if self._levels_at is None or now - self._levels_at >= self.LEVELS_EVERY_S:
            self._levels_at, self._levels = now, []
            for k in range(self.plan.max_level + 1):
                latency = self.estimator.estimate(k)
                self._levels.append(
                    {
                        "level": k,
                        "capacity_blocks": self.plan.capacity_blocks(k),
                        "latency_ms": None if latency is None else round(latency, 3),
                        "samples": self.estimator.samples(k),
                    }
                )
        levels = self._levels
        live = self.trace.live.as_dict()
        return {
            **live,
            "level": self.level,
            "target": self.policy.level,
            "max_level": self.plan.max_level,
            "cap": self.cap,
            "pin": self.pin,
            "rule": self.config.policy.rule,
            "block_size": block_size,
            "capacity_blocks": self.elastic.capacity_blocks,
            "capacity_tokens": self.elastic.capacity_blocks * block_size,
            "inflight": self.inflight is not None,
            "levels": levels,
            "control": {"applied": self.control_applied, "error": self.control_error},
            "priced_GBps": self.h2d_GBps,
            "piecewise_penalty_ms": self.piecewise_penalty_ms,
            # with vLLM's CPU KV offloading: what a lowering's drain may be waiting for
            "blocks_being_stored": self.elastic.blocks_being_stored,
        }

    def _record(self, step: int, waiting: int, running: int) -> None:
        pool = self.elastic.pool
        latency: dict[str, float | None] = {}
        if self.trace.enabled:  # the two levels the policy weighs, priced as it prices them
            mix = tuple(self._mix) if self.config.policy.proxy == "model" else ()
            levels = range(self.level, min(self.level + 1, self.plan.max_level) + 1)
            latency = self.estimator.snapshot(levels, mix)
        self.trace.step(
            step=step,
            level=self.level,
            target=self.policy.level,
            capacity_blocks=self.elastic.capacity_blocks,
            kv_util=round(pool.get_usage(), 4),
            waiting=waiting,
            running=running,
            draining=list(self.elastic.drain_targets),
            inflight=self.inflight.command_id if self.inflight else None,
            decision=self._decision,
            latency_ms=latency,
            **self._priced_fields(),
        )

    def _priced_fields(self) -> dict[str, float]:
        """What the last priced decision weighed (trace only); in a lull, the rent the
        level has cost since the pressure ended (the descent waits for it to pay the
        round trip)."""
        last = self._last
        if self.policy.calm_steps:
            return {"calm_ms": round(self.policy.calm_ms, 2)}
        if last is None or last.margin is None or last.proxy_current is None:
            return {}
        fields = {"proxy": round(last.proxy_current, 4), "margin": round(last.margin, 4)}
        exit_steps = self.lifetimes.exit_steps()
        if exit_steps is not None:  # what a climb's exit was priced with
            fields["exit_steps"] = exit_steps
        if last.proxy_next is not None:
            fields["proxy_next"] = round(last.proxy_next, 4)
        if last.priced_level is not None:
            fields["priced_level"] = last.priced_level
        return fields
