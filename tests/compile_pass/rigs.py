"""One rank's level-change machinery on the host backend (real VMM remapping), for tests:
an 8-layer toy decoder packed into 64 KiB pages, its prefetch engine and runtime, and a KV
cache of 64 one-block groups, 8 of them mapped."""

from __future__ import annotations

import torch

from dynoff.allocator import VmmArena
from dynoff.allocator.kv_cache import VmmKVCache
from dynoff.compile_pass.levels import LevelChanger
from dynoff.compile_pass.placement import WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from dynoff.compile_pass.runtime import OffloadRuntime
from tests.allocator.kv_config import kv_config
from tests.compile_pass.toy_model import ToyDecoder

N = 8
PAGE = 64 << 10


def host_level_changer(
    rank: int = 0, model: ToyDecoder | None = None, max_level: int = 2, pin_homes: str = "start"
) -> LevelChanger:
    """Rank ``rank``'s level changer over ``model`` (by default a seeded toy decoder). A
    level frees 3 pages and its tier of one-page groups takes 2."""
    if model is None:
        torch.manual_seed(0)
        model = ToyDecoder(N).requires_grad_(False)
    arena = VmmArena("host", page_size=PAGE)
    placement = WeightPlacement(arena, model.layers, max_level=max_level, pin_homes=pin_homes)
    engine = PrefetchEngine.for_placement(placement)
    runtime = OffloadRuntime(N, engine)
    kv = VmmKVCache(arena, kv_config(64, 1, PAGE), group_blocks=1, active_groups=8)
    return LevelChanger(rank, placement, kv, engine, runtime)
