"""VMM-backed KV buffers: reserved for the top capacity, mapped and unmapped per group."""

from __future__ import annotations

import pytest
import torch

from dynoff.allocator import ZERO_PAGE, PagePoolExhausted, VmmArena
from dynoff.allocator.kv_cache import VmmKVCache
from tests.allocator.kv_config import kv_config

PAGE = 64 << 10


def test_groups_map_and_unmap_pages_in_every_buffer() -> None:
    arena = VmmArena("host", page_size=PAGE)
    kv = VmmKVCache(arena, kv_config(16, 2, PAGE // 4), group_blocks=4, active_groups=2)
    tensors = kv.tensors()
    assert set(tensors) == {"l0", "l1"} and tensors["l0"].numel() == 16 * PAGE // 4
    first = kv.buffers[0].range.mapping()
    assert first[:2] != [ZERO_PAGE, ZERO_PAGE] and first[2:] == [ZERO_PAGE, ZERO_PAGE]
    tensors["l1"][: PAGE * 2].fill_(7)  # the mapped groups are writable memory
    with pytest.raises(PagePoolExhausted):  # no free pages: run time never creates any
        kv.map_groups([2])
    arena.create_pages(2)
    kv.map_groups([2])
    assert kv.buffers[1].range.mapping()[2] != ZERO_PAGE
    kv.unmap_groups([0, 2])
    assert sorted(kv.backed) == [1]
    assert torch.count_nonzero(tensors["l1"][:PAGE]) == 0  # back to the zero page
    assert arena.stats().pages_free == 4
