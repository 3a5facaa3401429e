"""The elastic block pool on real vLLM BlockPool / KVCacheManager objects.

A hypothesis state machine drives random allocations (with prefix-cache hits), frees,
grows, shrinks, drains and aborts, and after every operation checks: no block is both free
and allocated; free counts match the lists; the prefix map points only at live or free
blocks; no block of a retired group is ever handed out; the null block is intact; and the
utilisation vLLM reports counts only the active capacity.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from dynoff.policy.block_pool import ElasticBlockPool, GroupState
from dynoff.policy.geometry import KVLayout, plan_capacity, torch_reserved
from tests.policy.kv_fixtures import BLOCK_SIZE, SPEC, make_manager, make_request

PAGE = 64 << 10  # small pages keep groups small: 8 KiB blocks -> 8 blocks per group
GROUPS = 6


def layout(num_blocks: int) -> KVLayout:
    return KVLayout(num_blocks, (SPEC.page_size_bytes,) * 4, PAGE)


def test_group_geometry_matches_the_layout() -> None:
    real = KVLayout(1024, (SPEC.page_size_bytes,) * 4)  # 2 MiB pages
    assert real.group_blocks == 256
    assert real.pages_per_group == 4
    assert list(real.page_span(2, 3)) == [2]
    odd = KVLayout(100, (3 << 19,), PAGE * 32)  # 1.5 MiB blocks on 2 MiB pages: 4 per group
    assert odd.group_blocks == 4
    plan = plan_capacity(
        [SPEC.page_size_bytes] * 4, base_blocks=600, layer_bytes=9 << 20, max_level=2
    )
    assert (plan.group_blocks, plan.base_groups, plan.tier(0), plan.tier(1)) == (256, 2, 1, 1)
    assert plan.capacity_blocks(2) == plan.num_blocks == 1024


def test_pages_a_level_frees_beyond_whole_groups_carry_to_the_next_level() -> None:
    # Qwen3-32B with vLLM's packed layout (one 4 MiB block: 64 layers of 64 KiB) on 30 MiB
    # pages: a group is 15 blocks on 2 pages, a layer frees 31 pages. Level by level the odd
    # page waits for the next one's, so two levels hold 31 groups, not 2 x 15.
    plan = plan_capacity(
        [4 << 20], base_blocks=6000, layer_bytes=930 << 20, max_level=32, page_size=30 << 20
    )
    assert (plan.group_blocks, plan.pages_per_group, plan.layer_pages) == (15, 2, 31)
    assert [plan.tier(k) for k in range(4)] == [15, 16, 15, 16]
    assert plan.groups_at(2) - plan.groups_at(0) == 31
    assert plan.capacity_blocks(32) - plan.capacity_blocks(0) == 32 * 31 // 2 * 15
    # What a change maps always fits in the pages the freed layers left in the pool, and
    # what a lowering unmaps plus that remainder always gives the layer its pages back.
    for k in range(32):
        left = k * plan.layer_pages - (plan.groups_at(k) - plan.base_groups) * 2
        assert 0 <= left < 2
        assert plan.tier(k) * 2 <= left + plan.layer_pages


def test_level_0_matches_stock_where_its_allocator_would_round_up() -> None:
    # Qwen3-32B on the H200: 64 KV tensors of 64 KiB per block, groups of 32 blocks (one
    # 2 MiB page per tensor). vLLM sized 6,047 blocks: stock's 377.9 MiB tensors reserve
    # 378 MiB each, exactly 189 whole groups, so level 0 gets 6,048 blocks, not 188 groups.
    strides = [64 << 10] * 64
    plan = plan_capacity(strides, base_blocks=6047, layer_bytes=930 << 20, max_level=32)
    assert plan.group_blocks == 32
    assert plan.capacity_blocks(0) == 6048
    assert plan.capacity_blocks(0) * (64 << 10) <= torch_reserved(6047 * (64 << 10))
    exact = plan_capacity(strides, base_blocks=6048, layer_bytes=930 << 20, max_level=32)
    assert exact.capacity_blocks(0) == 6048
    # 1.5 MiB blocks, 4 per group (3 pages per tensor): 9 blocks are 13.5 MiB, which stock
    # reserves as 14 MiB; a third group would take 18 MiB, so level 0 keeps two (8 blocks).
    odd = plan_capacity([3 << 19] * 2, base_blocks=9, layer_bytes=64 << 20, max_level=1)
    assert (odd.group_blocks, odd.capacity_blocks(0)) == (4, 8)
    # The packed layout (one buffer, a block of all 64 layers is 4 MiB, groups of 15 on 30
    # MiB pages): stock's 64 per-layer tensors for 6,059 blocks reserve 84 MiB of rounding,
    # so the one block that completes group 404 (4 MiB) fits in it: 6,060, not 6,045.
    packed = plan_capacity(
        [4 << 20], 6059, 930 << 20, max_level=32, page_size=30 << 20, stock_block_bytes=strides
    )
    assert (packed.group_blocks, packed.capacity_blocks(0)) == (15, 6060)
    # Without stock's per-layer tensors to compare with, one buffer has no rounding to spare.
    alone = plan_capacity([4 << 20], 6059, 930 << 20, max_level=32, page_size=30 << 20)
    assert alone.capacity_blocks(0) == 6045
    # Below 10 MiB the allocator packs small buffers together: no rounding to lean on.
    small = plan_capacity([SPEC.page_size_bytes] * 4, 600, layer_bytes=9 << 20, max_level=2)
    assert small.capacity_blocks(0) == 512


def test_refuses_a_layer_that_frees_less_than_a_group() -> None:
    with pytest.raises(ValueError, match="frees less than one KV group"):
        plan_capacity([SPEC.page_size_bytes] * 4, base_blocks=600, layer_bytes=1 << 20, max_level=2)
    with pytest.raises(ValueError, match="do not fill one group"):
        plan_capacity([SPEC.page_size_bytes] * 4, base_blocks=10, layer_bytes=9 << 20, max_level=2)


def test_shrink_takes_free_groups_at_once_and_drains_the_rest() -> None:
    manager = make_manager(8 * GROUPS)
    elastic = ElasticBlockPool(
        manager.block_pool, layout(8 * GROUPS), active_groups=4, drain_lag_steps=2
    )
    assert manager.block_pool.num_gpu_blocks == 32
    request = make_request(list(range(20 * BLOCK_SIZE)))  # 20 blocks: groups 0..2
    assert manager.allocate_slots(request, 20 * BLOCK_SIZE) is not None
    held = set(manager.get_block_ids(request.request_id)[0])
    assert held == set(range(1, 21))
    # Two groups wanted; only group 3 is wholly free, so group 2 (most free blocks) drains.
    targets = elastic.begin_shrink(2, step=10)
    assert targets == (2, 3)
    assert elastic.draining and elastic.take_ready(step=99) == ()
    # Group 3 (blocks 24..31) left at once; group 2's free blocks 21..23 already left too;
    # 16..20 are held. 32 blocks - null - 20 held - 3 - 8 = 0 free.
    assert manager.block_pool.get_num_free_blocks() == 0
    assert manager.block_pool.num_gpu_blocks == 32 - 3 - 8
    manager.free(request)
    elastic.poll(step=11)
    assert elastic.take_ready(step=12) == ()  # the lag: step 12 may still write them
    assert elastic.take_ready(step=13) == (2, 3)
    elastic.commit_shrink((2, 3))
    assert manager.block_pool.num_gpu_blocks == 16
    assert elastic.invariant_violations() == []


def test_a_drain_held_up_by_a_long_request_moves_to_a_group_freed_since() -> None:
    """A long-output request holds a block of the target for thousands of steps while the
    rest of the load finishes: the drain swaps that target for a group that has become
    wholly free, the long request keeps its block, and the drain completes."""
    manager = make_manager(8 * GROUPS)
    elastic = ElasticBlockPool(manager.block_pool, layout(8 * GROUPS), active_groups=4)
    short = make_request(list(range(16 * BLOCK_SIZE)))  # blocks 1..16: groups 0..2
    long = make_request(list(range(5000, 5000 + 8 * BLOCK_SIZE)))  # 17..24: groups 2, 3
    assert manager.allocate_slots(short, 16 * BLOCK_SIZE) is not None
    assert manager.allocate_slots(long, 8 * BLOCK_SIZE) is not None
    assert elastic.begin_shrink(1, step=0) == (3,)  # the most free blocks: 25..31
    manager.free(short)  # group 1 (blocks 8..15) is now wholly free; group 3 is not
    for step in range(1, ElasticBlockPool.RETARGET_EVERY - 1):
        elastic.poll(step)
        assert elastic.drain_targets == (3,)  # no look before the retarget step
    elastic.poll(ElasticBlockPool.RETARGET_EVERY - 1)
    assert elastic.drain_targets == (1,) and elastic.retargeted == 1
    assert elastic.groups_in(GroupState.RECLAIMED) == [1]
    assert elastic.states[3] is GroupState.ACTIVE
    assert set(manager.get_block_ids(long.request_id)[0]) == set(range(17, 25))  # untouched
    assert elastic.take_ready(step=99) == (1,)
    elastic.commit_shrink((1,))
    assert manager.block_pool.num_gpu_blocks == 24
    assert elastic.invariant_violations() == []


def test_a_shrink_takes_the_free_group_with_the_least_cached_prefix() -> None:
    """Three wholly free groups; one holds a document's cached prefix. The shrink takes a
    clean one, and the document's next request still hits its prefix (the seed's policy
    reclaimed the highest free group whatever it held, and that prefix was recomputed)."""
    from dynoff.policy import hacks

    manager = make_manager(8 * GROUPS)
    pool = manager.block_pool
    elastic = ElasticBlockPool(pool, layout(8 * GROUPS), active_groups=4)
    filler = make_request(list(range(23 * BLOCK_SIZE)))  # blocks 1..23
    document = list(range(9000, 9000 + 8 * BLOCK_SIZE))
    first = make_request(document)  # blocks 24..31: group 3
    assert manager.allocate_slots(filler, 23 * BLOCK_SIZE) is not None
    assert manager.allocate_slots(first, 8 * BLOCK_SIZE) is not None
    manager.free(first)
    manager.free(filler)
    hacks.evict_prefix_hashes(pool, range(1, 24))  # the filler's prefix aged out: clean
    assert [b for b in range(32) if pool.blocks[b].block_hash is not None] == list(range(24, 32))
    assert elastic.begin_shrink(1, step=0) == (2,)  # not group 3, the highest free one
    again = make_request([*document, 1, 2, 3])
    _, hit_tokens, _ = manager.get_computed_blocks(again)
    assert hit_tokens == 8 * BLOCK_SIZE  # the whole document, from the cache
    assert elastic.invariant_violations() == []


def test_with_a_cpu_tier_a_prefix_it_holds_costs_nothing_to_drop() -> None:
    """Two free groups: group 2 holds 4 cached blocks the CPU KV tier does not hold, group 3
    a document of 8 that it does. Dropping group 3 costs reloads, dropping group 2
    recomputes, so the shrink takes group 3, where counting cached blocks alone would take
    group 2. (``held_below`` is the connector's answer, :func:`hacks.kv_connector_holds`;
    here the test says which blocks the tier holds.)"""
    from dynoff.policy import hacks

    manager = make_manager(8 * GROUPS)
    pool = manager.block_pool

    def held(block: KVCacheBlock) -> bool:
        return block.block_id in range(24, 32)

    elastic = ElasticBlockPool(pool, layout(8 * GROUPS), active_groups=4, held_below=held)
    filler = make_request(list(range(15 * BLOCK_SIZE)))  # blocks 1..15, kept: groups 0, 1
    other = make_request(list(range(5000, 5000 + 8 * BLOCK_SIZE)))  # blocks 16..23: group 2
    document = make_request(list(range(9000, 9000 + 8 * BLOCK_SIZE)))  # 24..31: group 3
    for request in (filler, other, document):
        assert manager.allocate_slots(request, request.num_tokens) is not None
    manager.free(document)
    manager.free(other)
    hacks.evict_prefix_hashes(pool, range(20, 24))  # group 2 keeps 4 cached blocks
    assert elastic._free_groups() == [3, 2]
    elastic._held_below = None  # the same pool without the tier's view
    assert elastic._free_groups() == [2, 3]
    elastic._held_below = held
    assert elastic.begin_shrink(1, step=0) == (3,)
    assert elastic.invariant_violations() == []


def test_abort_splices_reclaimed_blocks_back() -> None:
    manager = make_manager(8 * GROUPS)
    elastic = ElasticBlockPool(manager.block_pool, layout(8 * GROUPS), active_groups=3)
    request = make_request(list(range(12 * BLOCK_SIZE)))
    manager.allocate_slots(request, 12 * BLOCK_SIZE)  # blocks 1..12: groups 0 and 1
    elastic.begin_shrink(1, step=0)  # group 2 is free and goes at once
    assert elastic.groups_in(GroupState.RECLAIMED) == [2]
    other = make_request(list(range(1000, 1000 + 3 * BLOCK_SIZE)))
    assert manager.allocate_slots(other, 3 * BLOCK_SIZE) is not None  # uses the last 3 free
    assert elastic.should_abort()
    assert elastic.abort_drain() == (2,)
    assert manager.block_pool.get_num_free_blocks() == 8
    assert elastic.invariant_violations() == []


def test_a_held_drain_survives_a_dry_free_list_and_keeps_what_is_freed() -> None:
    """Stepping down under pressure: the pool is full, so an ordinary drain would abort at
    once. A held one does not. The freed blocks of the draining group leave the pool within
    ``free_blocks`` itself, so an allocation right after (as in the same ``schedule()``,
    where vLLM reuses what a preemption just freed) cannot take them back."""
    manager = make_manager(8 * GROUPS)
    pool = manager.block_pool
    elastic = ElasticBlockPool(pool, layout(8 * GROUPS), active_groups=3, drain_lag_steps=1)
    first = make_request(list(range(12 * BLOCK_SIZE)))  # blocks 1..12: groups 0 and 1
    second = make_request(list(range(1000, 1000 + 11 * BLOCK_SIZE)))  # 13..23: groups 1, 2
    assert manager.allocate_slots(first, 12 * BLOCK_SIZE) is not None
    assert manager.allocate_slots(second, 11 * BLOCK_SIZE) is not None
    assert pool.get_num_free_blocks() == 0

    assert elastic.begin_shrink(1, step=0, hold=True) == (2,)
    assert not elastic.should_abort()  # dry, but held
    manager.free(second)  # frees 13..23; 16..23 are group 2's
    assert pool.get_num_free_blocks() == 3  # 13..15 only: group 2's left at once
    third = make_request(list(range(2000, 2000 + 3 * BLOCK_SIZE)))
    assert manager.allocate_slots(third, 3 * BLOCK_SIZE) is not None
    assert set(manager.get_block_ids(third.request_id)[0]) == {13, 14, 15}
    assert pool.get_num_free_blocks() == 0 and not elastic.should_abort()
    elastic.poll(step=1)
    assert elastic.groups_in(GroupState.RECLAIMED) == [2]
    assert elastic.take_ready(step=2) == (2,)
    elastic.commit_shrink((2,))
    assert pool.num_gpu_blocks == 16
    assert elastic.invariant_violations() == []


def test_an_unheld_drain_still_aborts_when_the_free_list_runs_dry() -> None:
    manager = make_manager(8 * GROUPS)
    elastic = ElasticBlockPool(manager.block_pool, layout(8 * GROUPS), active_groups=3)
    request = make_request(list(range(23 * BLOCK_SIZE)))
    assert manager.allocate_slots(request, 23 * BLOCK_SIZE) is not None
    elastic.begin_shrink(1, step=0)
    assert elastic.should_abort()


class ElasticPoolMachine(RuleBasedStateMachine):
    """Random traffic and resizes against the real KVCacheManager."""

    def __init__(self) -> None:
        super().__init__()
        num_blocks = 8 * GROUPS
        self.manager = make_manager(num_blocks)
        self.elastic = ElasticBlockPool(
            self.manager.block_pool, layout(num_blocks), active_groups=3, drain_lag_steps=1
        )
        self.live: list = []
        self.step = 0
        self.handed_out: set[int] = set()

    @rule(prefix=st.integers(0, 3), blocks=st.integers(1, 6), extra=st.integers(0, 15))
    def allocate(self, prefix: int, blocks: int, extra: int) -> None:
        # Shared prefixes (prefix * 1000) make prefix-cache hits likely.
        tokens = [prefix * 1000 + i for i in range(blocks * BLOCK_SIZE)] + list(range(extra))
        request = make_request(tokens)
        computed, num_computed, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(
            request, len(tokens) - num_computed, num_computed, computed
        )
        if new is None:
            return
        self.live.append(request)
        self.handed_out.update(self.manager.get_block_ids(request.request_id)[0])

    @rule()
    def flood(self) -> None:
        """Allocate until the pool is full: drives drains into their abort path."""
        for _ in range(64):
            before = len(self.live)
            self.allocate(prefix=0, blocks=2, extra=len(self.live) + 1)
            if len(self.live) == before:
                return

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        self.manager.free(self.live.pop(index % len(self.live)))

    @rule(groups=st.integers(1, 2))
    def grow(self, groups: int) -> None:
        if len(self.elastic.groups_in(GroupState.RETIRED)) >= groups:
            chosen = self.elastic.begin_grow(groups)
            self.elastic.commit_grow(chosen)

    @rule(groups=st.integers(1, 2))
    def grow_fails(self, groups: int) -> None:
        if len(self.elastic.groups_in(GroupState.RETIRED)) >= groups:
            self.elastic.abort_grow(self.elastic.begin_grow(groups))

    @precondition(lambda self: not self.elastic.draining)
    @rule(groups=st.integers(1, 2), hold=st.booleans())
    def shrink(self, groups: int, hold: bool) -> None:
        active = [g for g in self.elastic.groups_in(GroupState.ACTIVE) if g != 0]
        if len(active) >= groups:
            self.elastic.begin_shrink(groups, self.step, hold=hold)

    @rule(unmap_fails=st.booleans())
    def tick(self, unmap_fails: bool) -> None:
        """One scheduler step: poll the drain, abort if starving, unmap what is ready."""
        self.step += 1
        self.elastic.poll(self.step)
        if self.elastic.should_abort():
            self.elastic.abort_drain()
        ready = self.elastic.take_ready(self.step)
        if ready:
            if unmap_fails:
                self.elastic.abort_shrink(ready)
            else:
                self.elastic.commit_shrink(ready)

    @invariant()
    def sound(self) -> None:
        assert self.elastic.invariant_violations() == []

    @invariant()
    def retired_blocks_never_handed_out(self) -> None:
        pool = self.manager.block_pool
        for g in self.elastic.groups_in(GroupState.RETIRED, GroupState.MAPPING):
            for b in self.elastic.layout.blocks_of(g):
                assert pool.blocks[b].ref_cnt == 0
                assert pool.blocks[b].prev_free_block is None

    @invariant()
    def usage_counts_active_capacity(self) -> None:
        pool = self.manager.block_pool
        in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        circulating = pool.num_gpu_blocks - 1
        assert pool.get_num_free_blocks() + in_use == circulating
        assert abs(pool.get_usage() - in_use / circulating) < 1e-9


TestElasticPool = ElasticPoolMachine.TestCase
TestElasticPool.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_shrink_drops_its_targets_prefix_hashes_even_for_blocks_in_use() -> None:
    # A hot prefix block in a draining group: each new request sharing the prefix would
    # touch it again, and it would never free. Its hash goes when the shrink starts.
    manager = make_manager(8 * GROUPS)
    elastic = ElasticBlockPool(manager.block_pool, layout(8 * GROUPS), active_groups=3)
    filler = make_request(list(range(5000, 5000 + 15 * BLOCK_SIZE)))  # blocks 1..15
    assert manager.allocate_slots(filler, 15 * BLOCK_SIZE) is not None
    prompt = list(range(4 * BLOCK_SIZE))
    hot = make_request([*prompt, 7])  # blocks 16..20: group 2
    assert manager.allocate_slots(hot, len(prompt) + 1) is not None
    assert set(manager.get_block_ids(hot.request_id)[0]) <= set(range(16, 24))
    _, hits_before, _ = manager.get_computed_blocks(make_request([*prompt, 8]))
    assert hits_before == 4 * BLOCK_SIZE
    assert elastic.begin_shrink(1, step=0) == (2,)
    _, hits_after, _ = manager.get_computed_blocks(make_request([*prompt, 9]))
    assert hits_after == 0  # no new request can pin group 2's blocks
    manager.free(hot)
    elastic.poll(step=1)
    assert elastic.groups_in(GroupState.RECLAIMED) == [2]
    assert elastic.invariant_violations() == []
