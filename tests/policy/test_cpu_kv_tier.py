"""The CPU KV tier issue on the scheduler side: the plugin's scheduler with vLLM's own CPU KV
offloading (``OffloadingConnector``, its scheduler half, real) on a real vLLM config (tiny
Llama, CPU).

vLLM frees a finished request's blocks at once and stores them to the CPU tier over the next
steps; a level lowered meanwhile must not unmap a block a store still reads, and the prefix
it held must come back from the CPU tier. The connector's worker half copies on a GPU only
(vLLM refuses it on its CPU build), so this test plays the worker: it reports each store job
complete when the test says, as the worker's ``OffloadingWorkerMetadata`` does. On the GPU
the real worker runs (``bench/gpu/README.md``, the CPU KV tier).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from dynoff.policy import hacks
from dynoff.policy.messages import ResizeOutcome, StepReport
from dynoff.policy.scheduler import DynamicOffloadScheduler
from tests.policy.test_scheduler import build as build_scheduler
from tests.policy.test_scheduler import finish_step

BLOCK = 16
PROMPT = 30 * BLOCK  # 30 full blocks: each is stored to the CPU tier


def build(
    tmp_path: Path, schedule: list[list[int]], connector: str = "OffloadingConnector"
) -> DynamicOffloadScheduler:
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_extra_config={
            "cpu_bytes_to_use": 64 << 20,
            "shared_storage_path": str(tmp_path / "kv"),
        },
    )
    return build_scheduler(tmp_path, schedule, transfer)


def request(rid: str, first_token: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first_token, first_token + PROMPT)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


class Worker:
    """The test's stand-in for the workers: every step it answers with the plugin's report
    (the level it ran at, a command applied) and the connector's completed store jobs, those
    the test has released."""

    def __init__(self, scheduler: DynamicOffloadScheduler) -> None:
        self.scheduler = scheduler
        self.level = 0
        self.stores: set[int] = set()  # store jobs issued, not yet reported complete
        self.release = False
        self.commands: list = []

    def step(self) -> None:
        output = self.scheduler.schedule()
        step = self.scheduler.current_step
        command = output.dynamic_offload  # type: ignore[attr-defined]
        outcomes: tuple[ResizeOutcome, ...] = ()
        if command is not None:
            self.commands.append(command)
            self.level = command.target_level
            outcomes = (ResizeOutcome(command.command_id, 0, True, ""),)
        self.stores |= set(output.kv_connector_metadata.store_jobs)
        done = OffloadingWorkerMetadata()
        if self.release:
            for job in sorted(self.stores):
                done.mark_completed(job)
            self.stores.clear()
        tokens = output.total_num_scheduled_tokens
        report = StepReport(step, self.level, 5.0, 0, tokens, outcomes)
        connector = KVConnectorOutput(kv_connector_worker_meta=done)
        finish_step(self.scheduler, output, report, connector)


def test_a_lowering_waits_for_the_cpu_tier_stores_and_the_prefix_comes_back_from_it(
    tmp_path: Path,
) -> None:
    # Level 1 at step 1, back to level 0 at step 3. Three requests of 30 blocks each (90 of
    # the 95 usable, level 1's groups among them) are prefilled at step 2, sample their one
    # token and finish; vLLM frees their blocks at once, and the stores to the CPU tier it
    # issued with the prefill are still copying when the lowering begins.
    scheduler = build(tmp_path, schedule=[[1, 1], [3, 0]])
    reads = hacks.kv_connector_reads(scheduler)
    assert reads is not None
    pool = scheduler.kv_cache_manager.block_pool
    worker = Worker(scheduler)
    worker.step()  # step 1: map level 1's groups
    assert scheduler.offload.level == 1 and pool.num_gpu_blocks == 96
    for i in range(3):
        scheduler.add_request(request(f"r{i}", 1000 * i))
    worker.step()  # step 2: prefill and the stores; every request finishes
    assert not scheduler.running and pool.get_num_free_blocks() == 95
    assert len(worker.stores) == 3 and len(reads()) == 90
    assert scheduler.offload.status(BLOCK)["blocks_being_stored"] == 90  # what operators see
    holds = hacks.kv_connector_holds(scheduler)
    assert holds is not None
    cached = [b for b in pool.blocks if b.block_hash is not None]
    assert len(cached) == 90 and not any(holds(b) for b in cached)  # stores not complete
    for _ in range(8):  # step 3 begins the drain; it would be ready two steps later
        worker.step()
    assert [c.unmap_groups for c in worker.commands] == [()]  # no unmap while stores read
    assert scheduler.offload.elastic.draining
    worker.release = True  # the worker reports the stores complete
    for _ in range(4):
        worker.step()
    assert not reads()
    still_cached = [b for b in pool.blocks if b.block_hash is not None]
    assert still_cached and all(holds(b) for b in still_cached)  # the CPU tier holds them now
    unmaps = [c for c in worker.commands if c.unmap_groups]
    assert len(unmaps) == 1 and scheduler.offload.level == 0 and pool.num_gpu_blocks == 64
    # The reclaimed blocks' prefixes left the GPU's prefix cache with their pages; the CPU
    # tier holds them: the same prompt is matched there and loaded back.
    again = request("again", 1000 * 2)
    on_gpu = scheduler.kv_cache_manager.get_computed_blocks(again)[1]
    assert on_gpu < PROMPT - BLOCK  # part of the prefix sat on the reclaimed groups
    scheduler.add_request(again)
    output = scheduler.schedule()
    loads = output.kv_connector_metadata.load_jobs
    loaded = sum(len(job.dst_spec.block_ids) for job in loads.values())
    assert loaded >= 1 and on_gpu + loaded * BLOCK == PROMPT  # the rest from the CPU tier
    # While it loads, vLLM parks it in skipped_waiting with its blocks allocated: KV would
    # not admit it sooner, so it is no pressure on the level (nor demand for blocks).
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert again in scheduler.skipped_waiting and hacks.num_waiting(scheduler) == 0
    assert scheduler._left_waiting == 0 and scheduler._demand_blocks == 0
    assert scheduler.offload.elastic.invariant_violations() == []
    scheduler.shutdown()


def test_a_connector_whose_copies_the_scheduler_cannot_see_is_refused(tmp_path: Path) -> None:
    """The workers refuse any connector but vLLM's CPU offloading at load time
    (``check_kv_connector``); the scheduler refuses too, naming the one it supports, since
    it could not keep that connector's blocks mapped while they are copied."""
    with pytest.raises(ValueError, match=r"ExampleConnector.*supports OffloadingConnector"):
        build(tmp_path, schedule=[], connector="ExampleConnector")
