"""KV-cache tensors over VMM ranges: reserved for the largest capacity, mapped per group.

Each distinct KV buffer of vLLM's ``KVCacheConfig`` (one per layer by default; one shared
buffer for the packed layout) becomes a range reserved for ``num_blocks`` blocks, of which
only the groups of the current capacity are backed by pages. The tensors handed to vLLM are
``int8`` views of the whole reservation, so ``num_blocks`` (and every address a CUDA graph
bakes in) is fixed from the start. Unbacked pages read the zero page; vLLM never hands out
their blocks, and unmapped pages are never zero-filled.

Group g occupies, in a buffer whose blocks are ``b`` bytes apart, bytes
``[g·G·b, (g+1)·G·b)`` (G = blocks per group), whole pages by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from dynoff.allocator.vmm import ZERO_PAGE, Op, VmmArena, VmmRange


@dataclasses.dataclass
class _Buffer:
    range: VmmRange
    stride: int  # bytes per block
    tensor: torch.Tensor  # int8 [size]
    layers: list[str]


class VmmKVCache:
    """The KV buffers of one worker, backed group by group.

    Args:
        arena: the worker's VMM arena (its pool supplies and takes back pages).
        kv_cache_config: vLLM's ``KVCacheConfig`` (sized for the highest level).
        group_blocks: blocks per group (from the capacity plan).
        active_groups: groups backed at start (level 0's capacity).
    """

    def __init__(
        self, arena: VmmArena, kv_cache_config: object, group_blocks: int, active_groups: int
    ) -> None:
        self.arena = arena
        self.group_blocks = group_blocks
        num_blocks: int = kv_cache_config.num_blocks  # type: ignore[attr-defined]
        self.buffers: list[_Buffer] = []
        packed: _Buffer | None = None
        for spec in kv_cache_config.kv_cache_tensors:  # type: ignore[attr-defined]
            stride = getattr(spec, "block_stride", 0)
            if stride and packed is not None:
                packed.layers.extend(spec.shared_by)
                continue
            stride = stride or spec.size // num_blocks
            if (group_blocks * stride) % arena.page_size:
                raise ValueError(
                    f"a group of {group_blocks} blocks of {stride} bytes is not whole pages"
                )
            vrange = arena.reserve(arena.pages_for(spec.size))
            buffer = _Buffer(
                vrange, stride, vrange.tensor(torch.int8, (spec.size,)), list(spec.shared_by)
            )
            self.buffers.append(buffer)
            if getattr(spec, "block_stride", 0):
                packed = buffer
        self.backed: dict[int, list[list[int]]] = {}  # group -> pages per buffer
        self.map_groups(range(active_groups), create=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        """layer name -> int8 KV tensor, as ``_allocate_kv_cache_tensors`` returns them."""
        return {name: b.tensor for b in self.buffers for name in b.layers}

    def pages_per_group(self) -> int:
        return sum(self.group_blocks * b.stride // self.arena.page_size for b in self.buffers)

    def maps_block(self, block: int) -> bool:
        """Whether ``block``'s group is backed by pages (its bytes may be read)."""
        return block // self.group_blocks in self.backed

    def group_bytes(self, group: int) -> list[torch.Tensor]:
        """Group ``group``'s bytes in each KV buffer (``int8`` views; unbacked ones fault
        or read the zero page)."""
        views = []
        for buffer in self.buffers:
            span = self.group_blocks * buffer.stride
            views.append(buffer.tensor[group * span : (group + 1) * span])
        return views

    def _span(self, buffer: _Buffer, group: int) -> range:
        per = self.group_blocks * buffer.stride // self.arena.page_size
        return range(group * per, (group + 1) * per)

    def map_groups(self, groups: Iterable[int], create: bool = False) -> None:
        """Back ``groups`` with free pool pages, in one transaction.

        Only start-up passes ``create`` (new physical pages); at run time the pages must
        come from a layer the level change just freed, else :class:`PagePoolExhausted`.
        """
        todo = [g for g in groups if g not in self.backed]
        need = len(todo) * self.pages_per_group()
        free = self.arena.stats().pages_free
        if create and need > free:
            self.arena.create_pages(need - free)
        pages = self.arena.allocate_pages(need)
        ops: list[Op] = []
        taken: dict[int, list[list[int]]] = {}
        cursor = 0
        for g in todo:
            taken[g] = []
            for b in self.buffers:
                span = self._span(b, g)
                chunk = pages[cursor : cursor + len(span)]
                cursor += len(span)
                ops += [(b.range, o, p) for o, p in zip(span, chunk, strict=True)]
                taken[g].append(chunk)
        try:
            self.arena.apply(ops)
        except Exception:
            self.arena.free_pages(pages)
            raise
        self.backed.update(taken)

    def unmap_groups(self, groups: Iterable[int], synchronize: bool = True) -> None:
        """Give ``groups``' pages back to the pool (after queued device work, by default)."""
        groups = list(groups)
        ops = [
            (b.range, o, ZERO_PAGE) for g in groups for b in self.buffers for o in self._span(b, g)
        ]
        self.arena.apply(ops, synchronize=synchronize)
        for g in groups:
            for chunk in self.backed.pop(g):
                self.arena.free_pages(chunk)
