"""HACK guard for :mod:`dynoff.policy.hacks`: each private part of vLLM's scheduler side the
plugin touches still behaves as the elastic pool relies on, checked on vLLM's real
``KVCacheManager`` / ``BlockPool`` (not only signatures): if vLLM changes one, these fail."""

from __future__ import annotations

import vllm

from dynoff.policy import hacks
from tests.policy.kv_fixtures import BLOCK_SIZE, make_manager, make_request


def test_written_against_this_vllm() -> None:
    assert vllm.__version__.startswith(hacks.VLLM_VERSION), (
        f"policy/hacks.py was written against vLLM {hacks.VLLM_VERSION}, found "
        f"{vllm.__version__}: re-check every item in its docstring, then update VLLM_VERSION"
    )


def test_a_block_taken_out_of_the_free_list_is_never_handed_out_and_comes_back_first() -> None:
    manager = make_manager(16)
    pool = manager.block_pool
    block = pool.blocks[5]
    assert hacks.in_free_list(block)
    hacks.remove_from_free_list(pool, block)
    assert not hacks.in_free_list(block)
    free, count = hacks.free_list(pool)
    assert count == pool.get_num_free_blocks() == 14 and block not in free
    request = make_request(list(range(14 * BLOCK_SIZE)))
    allocated = manager.allocate_slots(request, 14 * BLOCK_SIZE)
    assert allocated is not None and 5 not in manager.get_block_ids(request.request_id)[0]
    manager.free(request)
    hacks.prepend_to_free_list(pool, [block])
    assert hacks.in_free_list(block)
    again = make_request(list(range(1000, 1000 + BLOCK_SIZE)))
    assert manager.allocate_slots(again, BLOCK_SIZE) is not None
    assert manager.get_block_ids(again.request_id)[0] == [5]  # the head of the free list


def test_the_capacity_is_what_usage_is_measured_against() -> None:
    manager = make_manager(16)
    pool = manager.block_pool
    request = make_request(list(range(3 * BLOCK_SIZE)))
    assert manager.allocate_slots(request, 3 * BLOCK_SIZE) is not None
    assert hacks.capacity(pool) == 16
    usage = pool.get_usage()
    for block_id in range(8, 16):  # half the pool out of circulation
        hacks.remove_from_free_list(pool, pool.blocks[block_id])
    hacks.set_capacity(pool, 8)
    assert hacks.capacity(pool) == 8
    assert pool.get_usage() > usage and abs(pool.get_usage() - 3 / 7) < 1e-9


def test_the_wrapped_free_blocks_sees_every_block_vllm_frees() -> None:
    manager = make_manager(16)
    pool = manager.block_pool
    freed: list[int] = []

    def wrap(original: hacks.FreeBlocks) -> hacks.FreeBlocks:
        def free_blocks(blocks):  # type: ignore[no-untyped-def]
            blocks = list(blocks)
            original(blocks)
            freed.extend(b.block_id for b in blocks if hacks.in_free_list(b))

        return free_blocks

    hacks.wrap_free_blocks(pool, wrap)
    request = make_request(list(range(2 * BLOCK_SIZE)))
    assert manager.allocate_slots(request, 2 * BLOCK_SIZE) is not None
    ids = manager.get_block_ids(request.request_id)[0]
    manager.free(request)  # vLLM's own path: the wrapper runs after the original
    assert sorted(freed) == sorted(ids)


def test_prefix_hashes_are_seen_and_evicted() -> None:
    manager = make_manager(16)
    pool = manager.block_pool
    prompt = list(range(2 * BLOCK_SIZE + 3))
    request = make_request(prompt)
    assert manager.allocate_slots(request, len(prompt)) is not None
    manager.free(request)
    cached = {b.block_id for b in hacks.prefix_cached_blocks(pool)}
    assert len(cached) == 2  # the two full blocks
    hacks.evict_prefix_hashes(pool, cached)
    assert hacks.prefix_cached_blocks(pool) == []
    hit, _, _ = manager.get_computed_blocks(make_request(prompt))
    assert hit.get_block_ids() == ([],)  # no prefix hit on an evicted block


def test_requests_the_scheduler_skipped_count_as_waiting(tmp_path) -> None:
    """``skipped_waiting`` is a request queue of vLLM's own scheduler, beside ``waiting``;
    the KV the waiting requests need comes from ``Request.num_tokens``."""
    from tests.policy.test_scheduler import build

    scheduler = build(tmp_path, schedule=[])
    assert hacks.num_waiting(scheduler) == 0
    scheduler.skipped_waiting.add_request(make_request(list(range(BLOCK_SIZE))))
    scheduler.add_request(make_request(list(range(100, 100 + BLOCK_SIZE))))
    assert hacks.num_waiting(scheduler) == 2
    # Their KV at most: a block-sized prompt and max_tokens=16 of output, 3 blocks each.
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6
    scheduler.add_request(make_request(list(range(200, 200 + 3 * BLOCK_SIZE + 1))))
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6 + 5
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=5) == 5  # stops at the limit
    # Only as many requests as the batch can still take count.
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100, max_requests=2) == 6
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100, max_requests=0) == 0
    scheduler.shutdown()


def test_a_request_loading_from_the_cpu_tier_or_its_grammar_is_not_kv_pressure(
    tmp_path,
) -> None:
    """vLLM parks a request whose KV is loading from the CPU tier (its blocks already
    allocated), or whose grammar compiles, in ``skipped_waiting``: more KV would not admit
    it sooner, so it is neither pressure nor demand. Counted, every CPU-tier hit would read
    as a queue refused for KV, and its prompt's blocks twice."""
    from vllm.v1.request import RequestStatus

    from tests.policy.test_scheduler import build

    scheduler = build(tmp_path, schedule=[])
    statuses = (
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        RequestStatus.WAITING_FOR_STREAMING_REQ,
    )
    for i, status in enumerate(statuses):
        request = make_request(list(range(1000 * i, 1000 * i + 2 * BLOCK_SIZE)))
        request.status = status
        scheduler.skipped_waiting.add_request(request)
    assert hacks.num_waiting(scheduler) == 0
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 0
    skipped = make_request(list(range(5000, 5000 + BLOCK_SIZE)))  # e.g. skipped for LoRA
    scheduler.skipped_waiting.add_request(skipped)
    assert hacks.num_waiting(scheduler) == 1
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 3
    scheduler.shutdown()


def test_demand_counts_a_shared_prefix_once_and_a_gpu_cached_prefix_not_at_all() -> None:
    """Questions on one document need its blocks once, and not at all while the GPU's
    prefix cache holds them: the demand a level is priced against is new blocks."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
    from vllm.v1.request import Request

    manager = make_manager(64)
    document = list(range(4 * BLOCK_SIZE))  # 4 full blocks

    def question(i: int) -> Request:
        return make_request([*document, 9000 + i])  # the document and one token more

    waiting = create_request_queue(SchedulingPolicy.FCFS)
    scheduler = SimpleNamespace(
        kv_cache_manager=manager,
        kv_cache_config=manager.kv_cache_config,
        waiting=waiting,
        skipped_waiting=create_request_queue(SchedulingPolicy.FCFS),
    )
    for i in range(3):
        waiting.add_request(question(i))
    # (4 * 16 + 1 + 16) // 16 + 1 = 6 blocks each; the document's 4 counted once.
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6 + 2 * (6 - 4)
    # Once a request on the document has run, the GPU caches its blocks: nobody needs them.
    first = question(99)
    assert manager.allocate_slots(first, first.num_tokens) is not None
    manager.free(first)
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 3 * (6 - 4)
    # A document the GPU no longer caches is needed again.
    hacks.evict_prefix_hashes(manager.block_pool, range(64))
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6 + 2 * (6 - 4)
