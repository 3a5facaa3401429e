"""Messages between the scheduler (policy, block pool) and the workers.

Scheduler -> worker: an :class:`OffloadCommand` rides on ``SchedulerOutput`` (attribute
``dynamic_offload``), so every rank gets it, in order, before that step's forward.
Worker -> scheduler: a :class:`StepReport` rides on ``ModelRunnerOutput`` (attribute
``dynamic_offload``) from rank 0, which gathers every rank's resize outcome first.
All fields are plain ints, floats, strings and tuples, so the messages pickle anywhere.
"""

from __future__ import annotations

import dataclasses

SCHEDULER_OUTPUT_ATTR = "dynamic_offload"
RUNNER_OUTPUT_ATTR = "dynamic_offload"


@dataclasses.dataclass(frozen=True)
class OffloadCommand:
    """Change the offload level and the KV groups backed by memory, before this step runs.

    Attributes:
        command_id: increasing id; the worker acknowledges it in a :class:`StepReport`.
        step: scheduler step the command was attached to.
        target_level: offload depth k the worker runs at from this step on.
        map_groups: KV groups to back with pages freed by raising the level (grow).
        unmap_groups: KV groups whose pages go back to weights (shrink); all their blocks are
            out of the pool and no step after ``safe_after_step`` touches them.
        safe_after_step: the worker must wait for this step's GPU work before unmapping.
    """

    command_id: int
    step: int
    target_level: int
    map_groups: tuple[int, ...] = ()
    unmap_groups: tuple[int, ...] = ()
    safe_after_step: int = -1


@dataclasses.dataclass(frozen=True)
class ResizeOutcome:
    """One rank's result of applying a command.

    Attributes:
        remap_ms: wall time of the whole change on this rank (the next three and the rest).
        sync_ms: waiting for queued GPU work and copies before touching any mapping.
        driver_ms: inside VMM driver calls (map, unmap, set access).
        copy_ms: restoring layers from pinned memory (lowering only).
        slots_changed: page slots remapped (weights and KV).
        audit: with ``audit_changes`` (debug), what the change altered that it must not
            have: KV groups mapped before and after whose bytes changed, resident layers
            not holding their own weights (:class:`~dynoff.compile_pass.levels.
            ChangeAudit`); empty when it altered nothing, or when not audited.

    :attr:`stall_ms` is what the change costs the device: the part of it after the queued
    work drained, while nothing runs until the next step is launched. The wait before it
    (``sync_ms``) overlaps the step still running, which the engine waits for anyway to
    read that step's output.
    """

    command_id: int
    rank: int
    ok: bool
    error: str = ""
    remap_ms: float = 0.0
    sync_ms: float = 0.0
    driver_ms: float = 0.0
    copy_ms: float = 0.0
    slots_changed: int = 0
    audit: tuple[str, ...] = ()

    @property
    def stall_ms(self) -> float:
        return max(0.0, self.remap_ms - self.sync_ms)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What rank 0 measured on the running engine before serving
    (:mod:`dynoff.compile_pass.calibrate`); it rides on the first :class:`StepReport`.

    Attributes:
        h2d_GBps: one layer's host-to-device copy, GB/s (0 when nothing is offloadable).
        layer_copy_ms: that copy's time, ms.
        piecewise_penalty_ms: median over ``decode_steps`` of piecewise minus FULL, ms.
        decode_steps: ``(batch, FULL ms, piecewise ms, level-1 ms)`` per decode batch: the
            first two at level 0, the last at level 1 (what a level costs here).
        stall_up_ms / stall_down_ms: one level change 0 -> 1 / 1 -> 0 on an idle device.
        driver_ms: of those two, the time inside VMM driver calls.
        lock_ms: page-locking one level's two homes, which a level's first entry waits for
            under ``pin_homes: "first_raise"`` (measured on level 1's; 0 where the homes
            were locked at start-up).
    """

    h2d_GBps: float
    layer_copy_ms: float
    piecewise_penalty_ms: float = 0.0
    decode_steps: tuple[tuple[int, float, float, float], ...] = ()
    stall_up_ms: float = 0.0
    stall_down_ms: float = 0.0
    driver_ms: float = 0.0
    lock_ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """The KV capacity plan one rank serves with, and what its real layers free; every
    rank's rides on the first :class:`StepReport`, and the scheduler refuses to go on if
    its own plan differs (:func:`dynoff.policy.geometry.check_worker_plans`).

    Attributes:
        rank: the worker's global rank.
        kv_layout: ``"packed"`` or ``"per_layer"``, as the worker resolved it.
        page_size: the VMM page the weights and KV tiers move on, bytes.
        num_blocks: blocks in the KV tensors (the highest level's capacity).
        group_blocks / base_groups / max_level / layer_pages / pages_per_group: the
            :class:`~dynoff.policy.geometry.CapacityPlan` the worker maps.
        real_layer_pages: pages one offloaded layer's pack really spans on this rank; a
            level frees these, and the plan may promise no more than them.
    """

    rank: int
    kv_layout: str
    page_size: int
    num_blocks: int
    group_blocks: int
    base_groups: int
    max_level: int
    layer_pages: int
    pages_per_group: int
    real_layer_pages: int


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What the worker measured for one step, plus resize outcomes since the last report.

    Attributes:
        step: scheduler step this forward belonged to.
        level: the offload depth the forward ran at.
        forward_ms: forward time (CUDA events on GPU, host timer on CPU).
        num_decode_tokens / num_prefill_tokens: the step's composition (the policy's latency
            filter keeps steps without prefill tokens).
        outcomes: resize results, one per rank per command applied.
        calibration: the start-up measurements, on the first report only.
        plans: every rank's :class:`PlanReport`, on the first report only.
        last_command / level_now: the id of the last command this rank processed (applied
            or refused; -1 before any) and the level it is at now (None: not reported): what
            settles a command whose outcome report was lost, and, with no command in flight,
            must be the scheduler's level (:class:`~dynoff.policy.controller.LevelsDisagreeError`).
        restore_wait_ms: device time the compute stream waited for a lowering's
            asynchronous restore copy, over waits finished since the last report: the part
            of a change down that the change's own ``stall_ms`` does not see.
        num_context_tokens: the KV the step's decode requests read, in tokens (their
            computed tokens before the step).
        link_GBps: with a paced device home (the fast-link emulation), the bandwidth its
            copies reached lately while serving (:attr:`~dynoff.compile_pass.homes.Pacer.
            achieved_GBps`), every ``LINK_REPORT_STEPS`` steps; None otherwise.
        prefill_pairs: the (query, key) pairs the step's prefill chunks attend
            (:func:`~dynoff.policy.latency.prefill_pairs`), for the trace.
    """

    step: int
    level: int
    forward_ms: float
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    outcomes: tuple[ResizeOutcome, ...] = ()
    calibration: Calibration | None = None
    restore_wait_ms: float = 0.0
    plans: tuple[PlanReport, ...] = ()
    last_command: int = -1
    level_now: int | None = None
    num_context_tokens: int = 0
    link_GBps: float | None = None
    prefill_pairs: int = 0

    @property
    def timed(self) -> bool:
        """The report carries a finished forward. Under async scheduling a report can come
        before any forward has finished (0 ms, 0 tokens), and a step with nothing scheduled
        times only vLLM's early return; neither is a step time."""
        return self.forward_ms > 0 and self.num_decode_tokens + self.num_prefill_tokens > 0

    def failed(self, command_id: int) -> list[ResizeOutcome]:
        return [o for o in self.outcomes if o.command_id == command_id and not o.ok]
