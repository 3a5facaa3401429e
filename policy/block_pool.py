"""Elastic KV block pool: grows and shrinks vLLM's BlockPool in whole page-aligned groups.

vLLM's ``BlockPool`` is built for the *largest* capacity any level reaches (``num_blocks``);
this class keeps the blocks of groups that are not backed by memory out of circulation, so
the scheduler only ever hands out mapped blocks. It keeps BlockPool's own invariants:
``blocks[i].block_id == i``, block 0 is the null block, the free queue is vLLM's intrusive
list (O(1) ``remove``/``prepend_n``), cached free blocks leave the prefix map before they
leave the pool, and ``num_gpu_blocks`` counts the blocks in circulation so
``get_usage()`` reports utilisation of the *active* capacity.

A *group* is a run of ``group_blocks`` consecutive block ids that together fill whole pages
in every KV tensor: with a per-block stride of ``b`` bytes in a tensor and pages of ``P``
bytes, ``group_blocks = lcm over tensors of P / gcd(P, b)``. Group g covers blocks
``[g·G, (g+1)·G)`` and, in a tensor of stride b, bytes ``[g·G·b, (g+1)·G·b)``.

Group life cycle::

    RETIRED --begin_grow--> MAPPING --commit_grow--> ACTIVE
    ACTIVE --begin_shrink--> DRAINING --(all blocks free)--> RECLAIMED --take_ready-->
    UNMAPPING --commit_shrink--> RETIRED          (abort_drain / abort_shrink: back to ACTIVE)

A shrink takes wholly free groups first, those holding the fewest cached prefix blocks
first (a dropped prefix is a prompt recomputed). Nothing here waits: a shrink that cannot
complete at once drains as requests finish (a target still held by a request is swapped for
a group that has become wholly free), and is aborted (its blocks spliced back) if the free
list runs dry meanwhile. A *held* drain (the policy stepping down under pressure) is not
aborted: vLLM serves on with fewer free blocks, preempting if it must, until the draining
groups are free. A block of a draining group leaves the pool the moment it is freed
(``BlockPool.free_blocks`` is wrapped), so vLLM cannot hand it out again, not even within
the same ``schedule()``. Every private part
of ``BlockPool`` it touches goes through :mod:`.hacks`.

With vLLM's CPU KV offloading (a KV connector), a freed block may still be read by a copy
to the CPU tier: vLLM frees a finished request's blocks while their stores run. ``reads``
gives those blocks (:func:`.hacks.kv_connector_reads`); a shrink prefers groups none of
whose blocks is being copied, and a drain is not complete, nor handed to the workers to
unmap, while any of its blocks is. A cached prefix on a reclaimed group is thereby saved to
the CPU tier before its pages go, wherever the connector stores it. And among free groups,
the cached blocks that count against a group are those the CPU tier does not hold
(``held_below``): a block it holds is reloaded on its next hit, not recomputed.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Iterable

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from dynoff.policy import hacks
from dynoff.policy.geometry import KVLayout


class GroupState(enum.Enum):
    ACTIVE = "active"
    RETIRED = "retired"
    MAPPING = "mapping"
    DRAINING = "draining"
    RECLAIMED = "reclaimed"
    UNMAPPING = "unmapping"


@dataclasses.dataclass
class _Drain:
    targets: tuple[int, ...]
    started_step: int
    blocks: frozenset[int] = frozenset()  # every block id of the targets
    hold: bool = False  # under pressure: never aborted for a dry free list
    ready_step: int | None = None


class ElasticBlockPool:
    """Grows and shrinks a live vLLM ``BlockPool`` by whole groups (see the module doc)."""

    RETARGET_EVERY = 16  # steps between looks for a free group to swap a stuck target for

    def __init__(
        self,
        pool: BlockPool,
        layout: KVLayout,
        active_groups: int,
        drain_lag_steps: int = 2,
        reads: Callable[[], Collection[int]] | None = None,
        held_below: Callable[[KVCacheBlock], bool] | None = None,
    ) -> None:
        if layout.num_blocks != hacks.capacity(pool):
            raise ValueError(
                f"layout has {layout.num_blocks} blocks, the BlockPool {hacks.capacity(pool)}"
            )
        if not 1 <= active_groups <= layout.num_groups:
            raise ValueError(f"active_groups={active_groups} outside [1, {layout.num_groups}]")
        self.pool = pool
        self.layout = layout
        self.drain_lag_steps = drain_lag_steps
        self._reads = reads  # blocks a KV connector is still copying out (see the module doc)
        self._held_below = held_below  # whether the CPU KV tier holds a block's content
        self.states = [GroupState.ACTIVE] * active_groups + [GroupState.RETIRED] * (
            layout.num_groups - active_groups
        )
        self._out: set[int] = set()  # block ids out of circulation
        self._drain: _Drain | None = None
        self.retargeted = 0  # drain targets swapped for groups that became free
        # Blocks past the last whole group can never be backed: keep them out for good.
        tail = range(layout.num_groups * layout.group_blocks, layout.num_blocks)
        self._take_out(tail)
        for group in range(active_groups, layout.num_groups):
            self._take_out(layout.blocks_of(group))
        self._sync_capacity()
        self._pool_free_blocks: hacks.FreeBlocks
        hacks.wrap_free_blocks(pool, self._wrap_free_blocks)

    # -- queries ------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._drain is not None

    @property
    def drain_started_step(self) -> int | None:
        return self._drain.started_step if self._drain else None

    @property
    def drain_targets(self) -> tuple[int, ...]:
        return self._drain.targets if self._drain else ()

    def groups_in(self, *states: GroupState) -> list[int]:
        return [g for g, s in enumerate(self.states) if s in states]

    @property
    def capacity_blocks(self) -> int:
        """Blocks in circulation (allocated or free), the null block included."""
        return hacks.capacity(self.pool)

    def _in_free_queue(self, block: KVCacheBlock) -> bool:
        return hacks.in_free_list(block)

    @property
    def blocks_being_stored(self) -> int | None:
        """Free blocks a KV connector is still copying out (None: no connector)."""
        return None if self._reads is None else len(self._reads())

    def _being_read(self, blocks: Iterable[int]) -> bool:
        """Whether a KV connector's copy may still read any of ``blocks``."""
        if self._reads is None:
            return False
        reading = self._reads()
        return bool(reading) and any(b in reading for b in blocks)

    def _group_free(self, group: int) -> bool:
        return all(self._in_free_queue(self.pool.blocks[b]) for b in self.layout.blocks_of(group))

    # -- growing ------------------------------------------------------------------------------
    def begin_grow(self, num_groups: int) -> tuple[int, ...]:
        """Pick ``num_groups`` retired groups to back with memory (lowest ids first)."""
        retired = self.groups_in(GroupState.RETIRED)
        if num_groups > len(retired):
            raise ValueError(f"cannot grow by {num_groups} groups: {len(retired)} retired")
        chosen = tuple(retired[:num_groups])
        for g in chosen:
            self.states[g] = GroupState.MAPPING
        return chosen

    def commit_grow(self, groups: Iterable[int]) -> None:
        """The workers mapped ``groups``: their blocks become allocatable."""
        for g in self._expect(groups, GroupState.MAPPING):
            self.states[g] = GroupState.ACTIVE
            self._put_back(self.layout.blocks_of(g))
        self._sync_capacity()

    def abort_grow(self, groups: Iterable[int]) -> None:
        """The workers failed to map ``groups``: they stay retired."""
        for g in self._expect(groups, GroupState.MAPPING):
            self.states[g] = GroupState.RETIRED

    # -- shrinking ----------------------------------------------------------------------------
    def begin_shrink(self, num_groups: int, step: int, hold: bool = False) -> tuple[int, ...]:
        """Start reclaiming ``num_groups`` active groups; returns the targets.

        Wholly free groups are taken first; the rest drain as their blocks are freed. A
        ``hold`` drain is not aborted when the free list runs dry (:meth:`should_abort`).
        """
        if self._drain is not None:
            raise RuntimeError("a shrink is already in progress")
        candidates = self._reclaimable()
        if num_groups > len(candidates):
            raise ValueError(f"cannot shrink by {num_groups} groups: {len(candidates)} active")
        targets = self._free_groups()[:num_groups]
        if len(targets) < num_groups:
            rest = [g for g in candidates if g not in targets]
            rest.sort(key=lambda g: (-self._free_count(g), self._cached_count(g), -g))
            targets += rest[: num_groups - len(targets)]
        for g in targets:
            self.states[g] = GroupState.DRAINING
        blocks = frozenset(b for g in targets for b in self.layout.blocks_of(g))
        # Drop the targets' prefix hashes now, in-use blocks included: a hot prefix block
        # would otherwise be touched by every new request that shares it and never free.
        hacks.evict_prefix_hashes(self.pool, blocks)
        self._drain = _Drain(tuple(sorted(targets)), started_step=step, blocks=blocks, hold=hold)
        self.poll(step)
        return self._drain.targets if self._drain else tuple(sorted(targets))

    def _reclaimable(self) -> list[int]:
        """Active groups, but group 0: it holds block 0, the null block, never reclaimed."""
        return [g for g in self.groups_in(GroupState.ACTIVE) if g != 0]

    def _free_groups(self, excluding: Iterable[int] = ()) -> list[int]:
        """Reclaimable groups whose blocks are all free, in the order a shrink takes them:
        the fewest cached prefix blocks first (a dropped prefix is a prompt recomputed on
        its next hit), then the highest id; a group a KV connector is copying out goes
        last."""
        skip = set(excluding)
        free = [g for g in reversed(self._reclaimable()) if g not in skip and self._group_free(g)]
        free.sort(  # stable: highest ids first among equals
            key=lambda g: (self._being_read(self.layout.blocks_of(g)), self._cached_count(g))
        )
        return free

    def _cached_count(self, group: int) -> int:
        """Blocks of ``group`` whose prefix-cache entry (vLLM's ``block_hash``) would be lost
        with it: with a CPU KV tier, those it does not hold (a held one is reloaded, not
        recomputed)."""
        blocks = (self.pool.blocks[b] for b in self.layout.blocks_of(group))
        cached = [block for block in blocks if block.block_hash is not None]
        if self._held_below is None:
            return len(cached)
        return sum(not self._held_below(block) for block in cached)

    def _free_count(self, group: int) -> int:
        return sum(self._in_free_queue(self.pool.blocks[b]) for b in self.layout.blocks_of(group))

    def poll(self, step: int) -> None:
        """Move newly freed blocks of draining groups out; note when the drain completes.
        Every :attr:`RETARGET_EVERY` steps, a target still held by a request is swapped for
        an active group that has become wholly free since (:meth:`_retarget`)."""
        drain = self._drain
        if drain is None or drain.ready_step is not None:
            return
        if (step - drain.started_step) % self.RETARGET_EVERY == self.RETARGET_EVERY - 1:
            self._retarget(drain)
        for g in drain.targets:
            freed = [
                b for b in self.layout.blocks_of(g) if self._in_free_queue(self.pool.blocks[b])
            ]
            self._take_out(freed)
        self._sync_capacity()
        if all(b in self._out for b in drain.blocks) and not self._being_read(drain.blocks):
            for g in drain.targets:
                self.states[g] = GroupState.RECLAIMED
            drain.ready_step = step + self.drain_lag_steps

    def _retarget(self, drain: _Drain) -> None:
        """Swap each target that still has a block in use for an active group whose blocks
        are all free now. The targets are chosen when the drain starts; a long request (a
        few thousand tokens of output) can hold one of them for thousands of steps while,
        with the load gone, whole other groups sit free. A swapped-out target takes its
        reclaimed blocks back into the free list; the workers learn the groups only when
        the drain is complete."""
        stuck = [
            g
            for g in drain.targets
            if any(
                b not in self._out and not self._in_free_queue(self.pool.blocks[b])
                for b in self.layout.blocks_of(g)
            )
        ]
        if not stuck:
            return
        targets = set(drain.targets)
        swaps = list(zip(stuck, self._free_groups(excluding=targets), strict=False))
        if not swaps:
            return
        for old, new in swaps:
            self.states[old] = GroupState.ACTIVE
            self._put_back([b for b in self.layout.blocks_of(old) if b in self._out])
            self.states[new] = GroupState.DRAINING
            targets.discard(old)
            targets.add(new)
        drain.targets = tuple(sorted(targets))
        drain.blocks = frozenset(b for g in drain.targets for b in self.layout.blocks_of(g))
        self.retargeted += len(swaps)

    def overdue(self, step: int, limit_steps: int) -> bool:
        """A drain still waiting for blocks ``limit_steps`` steps after it began."""
        drain = self._drain
        return (
            drain is not None
            and drain.ready_step is None
            and step - drain.started_step >= limit_steps
        )

    def should_abort(self) -> bool:
        """A drain (not held) in progress and the main free list ran dry: give the blocks
        back."""
        drain = self._drain
        return drain is not None and not drain.hold and self.pool.get_num_free_blocks() == 0

    def _wrap_free_blocks(self, original: hacks.FreeBlocks) -> hacks.FreeBlocks:
        self._pool_free_blocks = original
        return self._free_blocks

    def _free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """``BlockPool.free_blocks``, then the freed blocks of a draining group leave."""
        blocks = list(ordered_blocks)
        self._pool_free_blocks(blocks)
        drain = self._drain
        if drain is None or drain.ready_step is not None:
            return
        freed = [
            b.block_id for b in blocks if b.block_id in drain.blocks and self._in_free_queue(b)
        ]
        if freed:
            self._take_out(freed)
            self._sync_capacity()

    def abort_drain(self) -> tuple[int, ...]:
        """Splice every reclaimed block back into the free list; targets become active."""
        drain, self._drain = self._drain, None
        if drain is None:
            return ()
        for g in drain.targets:
            self.states[g] = GroupState.ACTIVE
            self._put_back([b for b in self.layout.blocks_of(g) if b in self._out])
        self._sync_capacity()
        return drain.targets

    def take_ready(self, step: int) -> tuple[int, ...]:
        """Groups drained at least ``drain_lag_steps`` ago, now safe to unmap (else ()). Asked
        again here whether a KV connector reads them: a request that finished before the drain
        completed gets its last store in the schedule after (vLLM builds it then)."""
        drain = self._drain
        if drain is None or drain.ready_step is None or step < drain.ready_step:
            return ()
        if self._being_read(drain.blocks):
            return ()
        self._drain = None
        for g in drain.targets:
            self.states[g] = GroupState.UNMAPPING
        return drain.targets

    def commit_shrink(self, groups: Iterable[int]) -> None:
        for g in self._expect(groups, GroupState.UNMAPPING):
            self.states[g] = GroupState.RETIRED

    def abort_shrink(self, groups: Iterable[int]) -> None:
        """The workers failed to unmap: the groups serve again."""
        for g in self._expect(groups, GroupState.UNMAPPING):
            self.states[g] = GroupState.ACTIVE
            self._put_back(self.layout.blocks_of(g))
        self._sync_capacity()

    # -- plumbing -----------------------------------------------------------------------------
    def _expect(self, groups: Iterable[int], state: GroupState) -> list[int]:
        groups = list(groups)
        wrong = [g for g in groups if self.states[g] is not state]
        if wrong:
            raise ValueError(f"groups {wrong} are not {state.value}")
        return groups

    def _take_out(self, block_ids: Iterable[int]) -> None:
        ids = [b for b in block_ids if b not in self._out]
        if not ids:
            return
        hacks.evict_prefix_hashes(self.pool, ids)  # drop prefix hashes before they leave
        for b in ids:
            block = self.pool.blocks[b]
            if self._in_free_queue(block):
                hacks.remove_from_free_list(self.pool, block)
            self._out.add(b)

    def _put_back(self, block_ids: Iterable[int]) -> None:
        blocks = [self.pool.blocks[b] for b in block_ids if b in self._out]
        for block in blocks:
            self._out.discard(block.block_id)
        hacks.prepend_to_free_list(self.pool, blocks)

    def _sync_capacity(self) -> None:
        hacks.set_capacity(self.pool, self.layout.num_blocks - len(self._out))

    def invariant_violations(self) -> list[str]:
        """Every broken invariant, described (empty when the pool is sound)."""
        pool, problems = self.pool, []
        free, num_free = hacks.free_list(pool)
        free_ids = {b.block_id for b in free}
        if len(free) != num_free:
            problems.append("free count does not match the free list")
        if any(pool.blocks[b].ref_cnt > 0 for b in free_ids):
            problems.append("a block is both free and allocated")
        if free_ids & self._out:
            problems.append("a block out of circulation is on the free list")
        idle = (GroupState.RETIRED, GroupState.MAPPING, GroupState.RECLAIMED, GroupState.UNMAPPING)
        for g, state in enumerate(self.states):
            if state in idle and any(pool.blocks[b].ref_cnt for b in self.layout.blocks_of(g)):
                problems.append(f"group {g} ({state.value}) has an allocated block")
        for block in hacks.prefix_cached_blocks(pool):
            if block.block_id in self._out:
                problems.append(f"prefix map points at block {block.block_id}, out of the pool")
        null = pool.blocks[0]
        if not null.is_null or pool.null_block is not null or self._in_free_queue(null):
            problems.append("the null block is not intact")
        if hacks.capacity(pool) != self.layout.num_blocks - len(self._out):
            problems.append("num_gpu_blocks does not count the blocks in circulation")
        return problems
