"""HACK(vllm-0.26.0-private): every part of vLLM's scheduler side the plugin touches beyond
its public surface, in one place.

Written against vLLM 0.26.0; ``tests/policy/test_hacks.py`` checks each one's behaviour on
vLLM's real ``BlockPool`` and ``KVCacheManager`` and fails if any changes.

vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``) is built for a fixed capacity. The
elastic pool (:mod:`.block_pool`) keeps blocks out of circulation by editing it in place:

1. ``KVCacheBlock.prev_free_block``: set while a block sits in the free list (the list is
   intrusive); the only O(1) way to ask whether a block is free.
2. ``BlockPool.free_block_queue`` (``FreeKVCacheBlockQueue``): ``remove`` (O(1)) takes a
   block out of circulation, ``prepend_n`` puts blocks back at the head, so they are handed
   out first.
3. ``BlockPool.num_gpu_blocks``: the capacity ``get_usage()`` divides by; the plugin keeps
   it equal to the blocks in circulation.
4. ``BlockPool.free_blocks``: replaced *on the instance* by a wrapper that runs the original
   and then takes the freed blocks of a draining group out at once, before vLLM could hand
   them out again within the same ``schedule()``.
5. ``BlockPool.evict_blocks(block_ids)``: drops the blocks' prefix-cache hashes, so no hit
   points at a block out of circulation.
6. ``BlockPool.cached_block_hash_to_block._cache``: the prefix map's storage (a block or a
   ``{block_id: block}`` dict per hash), read by the invariant checks only.
7. ``Scheduler.skipped_waiting``: the requests a schedule skipped (beside ``waiting``),
   counted as pressure unless their status says KV would not admit them sooner (vLLM's
   ``Scheduler._is_blocked_waiting_status``: a load from the CPU tier, which already holds
   its blocks, a grammar, a streamed input); with ``Request.num_prompt_tokens``,
   ``max_tokens`` and ``block_hashes``, and ``BlockPool.get_cached_block``, the KV they
   may need beyond the prefixes the GPU already caches.
8. ``OffloadingConnectorScheduler._block_id_to_pending_jobs`` (``Scheduler.connector``'s
   ``connector_scheduler``, vLLM's CPU KV offloading): the GPU blocks of finished requests
   whose stores to the CPU tier have not completed. vLLM frees those blocks at once and
   only flushes the stores if it hands a block out again; a block in it is still being
   read by a copy, so the elastic pool does not unmap it (:func:`kv_connector_reads`).
9. ``CPUOffloadingManager._policy.get(key)`` (that connector's ``manager``; side-effect free,
   unlike ``lookup``, which counts a hit): whether the CPU tier holds a block's content,
   keyed as vLLM keys it (``make_offload_key(block hash, group)``). A cached block the CPU
   tier holds costs a reload if it is dropped, not a recompute (:func:`kv_connector_holds`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash, get_group_id
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request, RequestStatus

from dynoff.policy.config import SUPPORTED_KV_CONNECTORS

VLLM_VERSION = "0.26.0"

FreeBlocks = Callable[[Iterable[KVCacheBlock]], None]


def in_free_list(block: KVCacheBlock) -> bool:
    """Whether ``block`` sits in its pool's free list (1)."""
    return block.prev_free_block is not None


def remove_from_free_list(pool: BlockPool, block: KVCacheBlock) -> None:
    """Take a free block out of circulation (2)."""
    pool.free_block_queue.remove(block)


def prepend_to_free_list(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Put blocks back into circulation, at the head of the free list (2)."""
    pool.free_block_queue.prepend_n(blocks)


def free_list(pool: BlockPool) -> tuple[list[KVCacheBlock], int]:
    """The free list's blocks and its own count of them (2)."""
    queue = pool.free_block_queue
    return queue.get_all_free_blocks(), queue.num_free_blocks


def capacity(pool: BlockPool) -> int:
    """Blocks the pool counts as its capacity, the null block included (3)."""
    return int(pool.num_gpu_blocks)


def set_capacity(pool: BlockPool, num_blocks: int) -> None:
    """Make ``get_usage()`` measure against ``num_blocks`` (3)."""
    pool.num_gpu_blocks = num_blocks


def wrap_free_blocks(pool: BlockPool, wrap: Callable[[FreeBlocks], FreeBlocks]) -> None:
    """Replace this pool's ``free_blocks`` by ``wrap(original)`` (4)."""
    pool.free_blocks = wrap(pool.free_blocks)  # type: ignore[method-assign, assignment]


def evict_prefix_hashes(pool: BlockPool, block_ids: Iterable[int]) -> None:
    """Drop the prefix-cache hashes of ``block_ids`` (5)."""
    pool.evict_blocks(set(block_ids))


def prefix_cached_blocks(pool: BlockPool) -> list[KVCacheBlock]:
    """Every block the prefix-cache map points at (6)."""
    out: list[KVCacheBlock] = []
    for value in pool.cached_block_hash_to_block._cache.values():
        out.extend(value.values() if isinstance(value, dict) else [value])
    return out


# A waiting request in one of these states is not refused KV: more capacity would not
# admit it sooner (7). vLLM keeps such requests in ``skipped_waiting``.
_BLOCKED = frozenset(
    {
        RequestStatus.WAITING_FOR_REMOTE_KVS,  # loading from the CPU tier, its blocks held
        RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        RequestStatus.WAITING_FOR_STREAMING_REQ,
    }
)


def _refused(scheduler: Any) -> Iterator[Request]:
    """The waiting requests more KV could admit, in the order vLLM's FCFS schedule takes
    them (skipped ones first) (7)."""
    for request in scheduler.skipped_waiting:
        if request.status not in _BLOCKED:
            yield request
    yield from scheduler.waiting


def num_waiting(scheduler: Any) -> int:
    """Requests the last schedule left waiting for KV or the batch, skipped ones included,
    those waiting on something else (a CPU-tier load, a grammar) not (7)."""
    skipped = sum(r.status not in _BLOCKED for r in scheduler.skipped_waiting)
    return len(scheduler.waiting) + skipped


def _leading(hashes: Sequence[bytes], present: Callable[[bytes], bool]) -> int:
    """How many leading ``hashes`` are ``present``. Block hashes chain (each covers the
    whole prefix before it), so a cached prefix is a run from the start: a binary search,
    log2(blocks) lookups, not one per block."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        if present(hashes[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


def waiting_blocks(
    scheduler: Any, block_size: int, limit: int, max_requests: int | None = None
) -> int:
    """New KV blocks the waiting requests may need before they finish (7): each one's
    prompt and ``max_tokens`` of output (vLLM sets it for every request), in blocks, less
    its prompt's leading blocks that the GPU's prefix cache holds or that a request before
    it in the queue brings (questions on one document share its blocks). A request's
    footprint, not its prompt, is what a level's KV must hold: a short prompt with a long
    answer grows for thousands of steps. An upper bound still: early stops are not known.
    A block the CPU KV tier holds counts: it is loaded into a GPU block. Only the first
    ``max_requests`` requests count (the batch cannot take more), and the sum stops once it
    reaches ``limit``, so a long queue costs no more than a short one."""
    pool = scheduler.kv_cache_manager.block_pool
    groups = list(range(len(scheduler.kv_cache_config.kv_cache_groups)))
    seen: set[bytes] = set()

    def present(block_hash: bytes) -> bool:
        return block_hash in seen or pool.get_cached_block(block_hash, groups) is not None

    total = 0
    for n, request in enumerate(_refused(scheduler)):
        if max_requests is not None and n >= max_requests:
            break
        hashes = request.block_hashes
        shared = _leading(hashes, present) if hashes else 0
        seen.update(hashes[shared:])  # the leading ones are seen or cached already
        total += (request.num_prompt_tokens + request.max_tokens) // block_size + 1 - shared
        if total >= limit:
            return limit
    return total


def kv_connector_reads(scheduler: Any) -> Callable[[], Collection[int]] | None:
    """The GPU blocks the scheduler's KV connector may still be copying out (8), as a
    function read at each look, or None where no connector is configured. Refuses a
    connector whose pending copies it cannot see."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None
    name = type(connector).__name__
    inner = getattr(connector, "connector_scheduler", None)
    pending = getattr(inner, "_block_id_to_pending_jobs", None)
    if name not in SUPPORTED_KV_CONNECTORS or not isinstance(pending, dict):
        raise ValueError(
            f"kv_connector={name}: dynamic offload unmaps KV blocks and must know which ones "
            f"a connector may still be copying; it supports {', '.join(SUPPORTED_KV_CONNECTORS)} "
            "(vLLM's CPU KV offloading: --kv-offloading-size N), not this one"
        )
    return pending.keys  # the same dict for the connector's life (reset_cache clears it)


def kv_connector_holds(scheduler: Any) -> Callable[[KVCacheBlock], bool] | None:
    """Whether the CPU KV tier holds a GPU block's content, ready to load (9), or None where
    no connector is configured (or its manager keeps no such map)."""
    connector = getattr(scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    policy = getattr(manager, "_policy", None)
    if policy is None or not callable(getattr(policy, "get", None)):
        return None

    def holds(block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        entry = policy.get(make_offload_key(get_block_hash(block_hash), get_group_id(block_hash)))
        return entry is not None and bool(entry.is_ready)

    return holds
