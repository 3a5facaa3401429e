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
    scheduler.add_request(make_request(list(range(BLOCK_SIZE))))
    assert hacks.num_waiting(scheduler) == 2
    # Their KV at most: a block-sized prompt and max_tokens=16 of output, 3 blocks each.
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6
    scheduler.add_request(make_request(list(range(3 * BLOCK_SIZE + 1))))
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=100) == 6 + 5
    assert hacks.waiting_blocks(scheduler, BLOCK_SIZE, limit=5) == 5  # stops at the limit
    scheduler.shutdown()
