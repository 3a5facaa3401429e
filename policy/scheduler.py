"""``--scheduler-cls dynoff.policy.scheduler.DynamicOffloadScheduler``.

A thin subclass of vLLM's ``AsyncScheduler``: each step it asks the
:class:`~dynoff.policy.controller.OffloadController` for a command and attaches it to the
``SchedulerOutput`` (attribute ``dynamic_offload``), and it feeds the workers'
``StepReport`` (``ModelRunnerOutput.dynamic_offload``) back to the controller.

vLLM internals touched (vLLM 0.26.0), each through :mod:`dynoff.policy.hacks`:
``Scheduler.kv_cache_manager.block_pool``'s free list and capacity, and
``Scheduler.skipped_waiting`` (a request loading its KV from the CPU tier holds its blocks:
it is not pressure) and, with vLLM's CPU KV offloading, its connector's pending stores and
what its CPU tier holds; besides, the public ``waiting``, ``running``, ``connector`` and
``current_step``.
Nothing is patched globally.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig

from dynoff.policy import hacks
from dynoff.policy.config import DynamicOffloadConfig
from dynoff.policy.controller import OffloadController
from dynoff.policy.geometry import (
    GRANULE,
    PlanMismatchError,
    choose_page_size,
    layout_strides,
    packed_kv_cache_config,
    plan_report,
    planned_layer_bytes,
    recover_plan,
    resolve_kv_layout,
    uses_v2_runner,
)
from dynoff.policy.messages import RUNNER_OUTPUT_ATTR, SCHEDULER_OUTPUT_ATTR
from dynoff.policy.status import StatusBoard, board_dir, published_max_level

logger = init_logger("vllm.dynoff.scheduler")


def page_size_for(
    config: DynamicOffloadConfig, layer_bytes: int, kv_cache_config: KVCacheConfig
) -> int:
    """The workers' VMM page, derived as they derive it (``DynamicOffloadMixin._page_size``):
    the host page on CPU, the granule for per-layer KV tensors, and for the packed layout the
    page :func:`choose_page_size` picks for the layer and the packed block."""
    if current_platform.is_cpu():
        return config.host_page_size
    if config.kv_layout == "packed":
        return choose_page_size(layer_bytes, layout_strides(kv_cache_config)[0])
    return GRANULE


def served_tokens(requests: dict[str, Any], num_scheduled_tokens: dict[str, int]) -> int:
    """The tokens a step serves, for the audit: a prompt once, whole, when its prefill
    completes (its cached part included), and a token of output for each request the step
    advances past its prompt. Not the tokens it computes: a prefix recomputed after a cache
    miss or a preemption is work done again, and a level that causes more of it (or saves
    it) must not be credited (or blamed) for it. ``Request.num_computed_tokens`` already
    counts this step's tokens (vLLM advances it in ``schedule()``)."""
    served = 0
    for req_id, scheduled in num_scheduled_tokens.items():
        request = requests.get(req_id)
        if request is None:
            continue
        after, prompt = request.num_computed_tokens, request.num_prompt_tokens
        if after < prompt:
            continue  # still prefilling: credited when it completes
        served += 1
        if after - scheduled < prompt and request.num_output_tokens == 0:
            served += prompt  # the first time its prefill completes (not after a preemption)
    return served


class DynamicOffloadScheduler(AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._left_waiting = 0
        self._demand_blocks = 0  # the KV blocks the requests left waiting need
        vllm_config = self.vllm_config
        extra = vllm_config.additional_config
        raw = extra.get(DynamicOffloadConfig.KEY) if isinstance(extra, dict) else None
        config = DynamicOffloadConfig.from_dict(raw)
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        num_layers = model_config.get_num_layers(parallel)
        layer_bytes = planned_layer_bytes(vllm_config, config.layer_bytes)
        max_level = self._workers_max_level(config, num_layers, layer_bytes)
        kv_cache_config = self.kv_cache_config
        kv_layout, _ = resolve_kv_layout(
            config.kv_layout,
            [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups],
            current_platform.is_cpu(),
            uses_v2_runner(vllm_config),
        )
        config = dataclasses.replace(config, kv_layout=kv_layout)  # as the workers resolved it
        if config.kv_layout == "packed":
            kv_cache_config = packed_kv_cache_config(kv_cache_config)
        plan, layout = recover_plan(
            kv_cache_config,
            layer_bytes,
            max_level,
            page_size_for(config, layer_bytes, kv_cache_config),
        )
        self.offload = OffloadController(
            config,
            plan,
            layout,
            self.kv_cache_manager.block_pool,
            num_ranks=parallel.world_size,
            num_layers=num_layers,
            layer_bytes=layer_bytes,
            expected_plan=plan_report(-1, plan, layout, config.kv_layout, plan.layer_pages),
            max_running=self.max_num_running_reqs,
            kv_connector_reads=hacks.kv_connector_reads(self),
            kv_connector_holds=hacks.kv_connector_holds(self),
        )
        block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._block_size = block_size
        self.board: StatusBoard | None = None
        try:
            self.board = StatusBoard(board_dir(vllm_config.instance_id))
        except (OSError, ValueError) as e:
            logger.warning("dynamic offload: no status board (metrics, endpoint): %s", e)
        self.offload.trace.event(
            "plan",
            kv_layout=config.kv_layout,
            page_size=layout.page_size,
            group_blocks=plan.group_blocks,
            group_tokens=plan.group_blocks * block_size,
            capacity_blocks_level_0=plan.capacity_blocks(0),
            max_level=max_level,
        )
        logger.info(
            "dynamic offload: %d layers, max level %d, KV capacity %d blocks at level 0 and "
            "+%.0f per level (groups of %d blocks)",
            num_layers,
            max_level,
            plan.capacity_blocks(0),
            plan.layer_pages / plan.pages_per_group * plan.group_blocks,
            plan.group_blocks,
        )

    def _workers_max_level(
        self, config: DynamicOffloadConfig, num_layers: int, layer_bytes: int
    ) -> int:
        """The max level the workers fitted to the host memory before they pinned it (read
        here, after they did, it would count their own copies against them), from rank 0's
        note on the status board; without one (a rank 0 on another host), the
        configuration's, which each worker's plan report is checked against on its first
        step."""
        configured = config.policy.resolve_max_level(num_layers, layer_bytes, None)
        try:
            published = published_max_level(board_dir(self.vllm_config.instance_id))
        except ValueError:
            published = None
        if published is None:
            return configured
        if published > configured:
            raise PlanMismatchError(
                f"the workers packed for max level {published} but the configuration allows "
                f"at most {configured}: were they started with another configuration?"
            )
        if published < configured:
            logger.info(
                "dynamic offload: max level %d, the largest the workers' host memory can pin",
                published,
            )
        return published

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        # Pressure is what the last schedule left waiting (refused for KV space or the batch
        # budget), not requests that arrived since and were never refused anything: counting
        # those would read every arrival as pressure and push the level up at light load.
        step = self.current_step + 1
        if self.board is not None and (control := self.board.poll_control()) is not None:
            self.offload.operate(int(control["seq"]), control.get("pin"), control.get("cap"))
        command = self.offload.on_schedule_start(
            step, self._left_waiting, len(self.running), self._demand_blocks
        )
        output = super().schedule(*args, **kwargs)
        self.offload.on_requests(
            step, (new.req_id for new in output.scheduled_new_reqs), output.finished_req_ids
        )
        self._left_waiting = hacks.num_waiting(self)
        room = max(self.max_num_running_reqs - len(self.running), 0)
        self._demand_blocks = (
            hacks.waiting_blocks(self, self._block_size, self.offload.plan.num_blocks, room)
            if self._left_waiting
            else 0
        )
        # The audit's count (a pass over the batch): only the priced rule has an audit.
        tokens = (
            served_tokens(self.requests, output.num_scheduled_tokens)
            if self.offload.audit is not None
            else 0
        )
        self.offload.on_schedule_end(step, tokens)
        setattr(output, SCHEDULER_OUTPUT_ATTR, command)
        self._publish()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> Any:
        report = getattr(model_runner_output, RUNNER_OUTPUT_ATTR, None)
        if report is not None:
            self.offload.on_report(report)
            self._publish()
        return super().update_from_output(scheduler_output, model_runner_output)

    def _publish(self) -> None:
        """The state on the status board: periodically, and at once after a change."""
        live = self.offload.trace.live
        if self.board is None or not (live.dirty or self.board.due()):
            return
        live.dirty = False
        try:
            self.board.publish(self.offload.status(self._block_size))
        except OSError as e:  # observability never stops serving
            logger.warning("dynamic offload: status board disabled: %s", e)
            self.board = None

    def shutdown(self) -> None:
        logger.info("dynamic offload: %s", self.offload.trace.summary())
        self.offload.trace.close()
        if self.board is not None:
            self.board.close()
        super().shutdown()
