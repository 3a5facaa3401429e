"""A stand-in with the shape of vLLM's ``KVCacheConfig`` (only the fields VmmKVCache reads),
so allocator tests run where vLLM is not installed (the GPU machine's allocator suite)."""

from __future__ import annotations

import types


def kv_config(num_blocks: int, layers: int, stride: int) -> types.SimpleNamespace:
    """``layers`` per-layer buffers of ``num_blocks`` blocks, ``stride`` bytes apart."""
    tensors = [
        types.SimpleNamespace(size=num_blocks * stride, shared_by=[f"l{i}"], block_stride=0)
        for i in range(layers)
    ]
    return types.SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors)
