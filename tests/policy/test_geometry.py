"""The packed KV layout and the page it moves on: both sides of the engine derive the same."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from dynoff.allocator import VmmArena
from dynoff.allocator.kv_cache import VmmKVCache
from dynoff.policy.geometry import (
    choose_page_size,
    decoder_layer_bytes,
    layout_strides,
    packed_kv_cache_config,
    per_layer_kv_cache_config,
    plan_capacity,
    recover_plan,
    resolve_kv_layout,
)

MiB = 1 << 20


def test_the_page_divides_the_pack_and_keeps_a_change_to_a_few_dozen_mappings() -> None:
    # Qwen3-32B: 930 MiB of matrices a layer, a packed block of 64 layers x 64 KiB.
    assert choose_page_size(930 * MiB, 4 * MiB) == 30 * MiB  # 31 pages, groups of 15 blocks
    # Qwen3-8B: 368 MiB, 36 layers x 64 KiB a block: 23 pages of 16 MiB.
    assert choose_page_size(368 * MiB, 36 * 64 << 10) == 16 * MiB
    # Llama-3.1-70B in fp8: 816 MiB, 80 layers x 64 KiB: 24 pages of 34 MiB.
    assert choose_page_size(816 * MiB, 5 * MiB) == 34 * MiB
    # A pack of 466 granules (2 x 233): no page up to 64 MiB but 4 MiB divides it; a larger
    # page would grow every layer's pack, and level 0's weights with it.
    assert choose_page_size(930 * MiB + 1, 4 * MiB) == 4 * MiB
    # A group may not be larger than what a level frees.
    assert choose_page_size(4 * MiB, 64 * MiB) == 2 * MiB


def config(num_blocks: int, spec: FullAttentionSpec, layers: int = 4) -> KVCacheConfig:
    return per_layer_kv_cache_config(num_blocks, spec, layers)


SPEC = FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
)  # 8 KiB a block a layer
STRIDED = dataclasses.replace(SPEC, indexes_kv_by_block_stride=True)


def test_packing_keeps_blocks_and_bytes_and_lays_layers_side_by_side() -> None:
    per_layer = config(1024, STRIDED)
    packed = packed_kv_cache_config(per_layer)
    assert packed.num_blocks == 1024
    assert layout_strides(packed) == (4 * 8192,)
    assert [t.offset for t in packed.kv_cache_tensors] == [0, 8192, 16384, 24576]
    assert {t.block_stride for t in packed.kv_cache_tensors} == {4 * 8192}
    assert packed.kv_cache_tensors[0].size == sum(t.size for t in per_layer.kv_cache_tensors)
    assert packed_kv_cache_config(packed) is packed  # already packed: as is
    assert per_layer.kv_cache_tensors[0].block_stride == 0  # the input is left alone


def test_packing_is_refused_where_vllm_could_not_read_it() -> None:
    with pytest.raises(ValueError, match="block stride"):
        packed_kv_cache_config(config(64, SPEC))
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
    )
    two = config(64, STRIDED)
    two.kv_cache_groups.append(KVCacheGroupSpec(["w"], window))
    with pytest.raises(ValueError, match="one KV cache group"):
        packed_kv_cache_config(two)


def test_the_packed_cache_backs_groups_on_large_pages_and_the_plans_agree() -> None:
    # 32 KiB blocks on 96 KiB host pages: a group is 3 blocks on 1 page; a "layer" of 10
    # pages frees 10 groups a level. The worker sizes, the scheduler recovers, same plan.
    page = 96 << 10
    plan = plan_capacity(
        [4 * 8192], base_blocks=30, layer_bytes=10 * page, max_level=2, page_size=page
    )
    packed = packed_kv_cache_config(config(plan.num_blocks, STRIDED))
    recovered, layout = recover_plan(packed, 10 * page, 2, page)
    assert recovered == plan and layout.block_bytes == (4 * 8192,)
    arena = VmmArena("host", page_size=page)
    kv = VmmKVCache(arena, packed, plan.group_blocks, plan.groups_at(0))
    assert len(kv.buffers) == 1 and len(kv.tensors()) == 4  # every layer views one buffer
    assert arena.stats().pages_allocated == plan.groups_at(0)  # one page a group
    kv.map_groups(range(plan.groups_at(0), plan.groups_at(1)), create=True)
    buffer = kv.buffers[0].tensor
    start = plan.capacity_blocks(0) * 4 * 8192
    buffer[start : start + 8192].fill_(7)  # a block of the new tier is writable
    assert int(buffer[start]) == 7
    kv.unmap_groups(range(plan.groups_at(0), plan.groups_at(1)))
    assert int(buffer[start]) == 0  # back on the zero page


def _both_sides(requested: str, kv_config: KVCacheConfig, on_cpu: bool, v2: bool):
    """The worker resolves from its per-layer specs, the scheduler from the KV groups."""
    per_layer = [g.kv_cache_spec for g in kv_config.kv_cache_groups for _ in g.layer_names]
    worker = resolve_kv_layout(requested, per_layer, on_cpu, v2)[0]
    groups = [g.kv_cache_spec for g in kv_config.kv_cache_groups]
    scheduler = resolve_kv_layout(requested, groups, on_cpu, v2)[0]
    assert worker == scheduler
    return worker


def test_auto_takes_the_packed_layout_only_where_it_applies_on_both_sides() -> None:
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
    )
    hybrid = config(64, STRIDED)
    hybrid.kv_cache_groups.append(KVCacheGroupSpec(["w"], window))
    assert _both_sides("auto", config(64, STRIDED), on_cpu=False, v2=True) == "packed"
    assert _both_sides("auto", config(64, STRIDED), on_cpu=True, v2=False) == "per_layer"
    assert _both_sides("auto", config(64, STRIDED), on_cpu=False, v2=False) == "per_layer"
    assert _both_sides("auto", config(64, SPEC), on_cpu=False, v2=True) == "per_layer"
    assert _both_sides("auto", hybrid, on_cpu=False, v2=True) == "per_layer"
    assert _both_sides("per_layer", config(64, STRIDED), on_cpu=False, v2=True) == "per_layer"
    _, why = resolve_kv_layout("auto", [SPEC], on_cpu=False, v2_runner=True)
    assert "block stride" in why  # the log line says why it fell back


def test_an_explicit_packed_layout_that_cannot_apply_is_refused_with_the_fix() -> None:
    assert resolve_kv_layout("packed", [STRIDED], False, True) == ("packed", "configured")
    with pytest.raises(ValueError, match=r"V2 model runner.*use \"auto\" or \"per_layer\""):
        resolve_kv_layout("packed", [STRIDED], on_cpu=False, v2_runner=False)
    with pytest.raises(ValueError, match="CPU engine"):
        resolve_kv_layout("packed", [STRIDED], on_cpu=True, v2_runner=False)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
    )
    with pytest.raises(ValueError, match="2 kinds of KV cache"):
        resolve_kv_layout("packed", [STRIDED, window], on_cpu=False, v2_runner=True)


def test_a_layer_is_sized_per_tensor_parallel_rank_with_kv_heads_replicated() -> None:
    """vLLM splits q/o heads and the MLP over the ranks, and replicates KV heads when there
    are fewer than ranks: a plan sized by total/tp would promise a rank fewer pages than its
    layer really spans (wasted), never more."""
    qwen3_32b = SimpleNamespace(
        hidden_size=5120,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=25600,
    )
    assert decoder_layer_bytes(qwen3_32b, 2) == 930 * MiB
    assert decoder_layer_bytes(qwen3_32b, 2, tp=8) == 930 * MiB // 8
    # 16 ranks, 8 KV heads: each rank holds one KV head's k and v, not half of one.
    per_rank = 5120 * 128 * (2 * 4 + 2 * 1) + 3 * 5120 * 1600
    assert decoder_layer_bytes(qwen3_32b, 2, tp=16) == 2 * per_rank > 930 * MiB // 16
