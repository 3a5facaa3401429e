"""Real vLLM KV-cache objects for policy tests: a KVCacheManager over a small model's layout."""

from __future__ import annotations

import itertools

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
)
from vllm.v1.request import Request

from dynoff.policy.geometry import per_layer_kv_cache_config

BLOCK_SIZE = 16
NUM_LAYERS = 4
# 2 (K, V) x 2 heads x 64 dims x 16 tokens x 2 bytes = 8 KiB per block per layer:
# a 2 MiB page holds 256 blocks of one layer, so a group is 256 blocks.
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16)

init_none_hash(sha256)
_ids = itertools.count()


def make_manager(num_blocks: int, page_size: int = 2 << 20) -> KVCacheManager:
    return KVCacheManager(
        per_layer_kv_cache_config(num_blocks, SPEC, NUM_LAYERS),
        max_model_len=8192,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )


def make_request(prompt: list[int]) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=16),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
