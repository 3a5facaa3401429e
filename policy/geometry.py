"""Sizes both sides must agree on: a decoder layer's bytes, the KV layout, the tier plan.

The worker sizes the KV tensors for ``plan_capacity(...).num_blocks`` (the highest level's
capacity) and the scheduler recovers the same plan from the resulting ``KVCacheConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from dynoff.policy.block_pool import CapacityPlan, KVLayout, plan_capacity


def decoder_layer_bytes(hf_config: Any, dtype_bytes: int) -> int:
    """Bytes of one dense decoder layer's pack (Llama / Qwen / Mistral families): its
    matrices, the attention projections and the gated MLP. Its vectors (norms, biases) stay
    resident outside the pack (``compile_pass.placement.packed_parameters``)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    inter = text.intermediate_size
    params = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o, k, v
    params += 3 * hidden * inter  # gate, up, down
    return params * dtype_bytes


def dtype_bytes(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2


def planned_layer_bytes(vllm_config: Any, configured: int | None) -> int:
    """The layer size both sides plan the KV tiers with: ``layer_bytes`` if the user set it,
    else :func:`decoder_layer_bytes` of the model's config, split over tensor-parallel ranks.
    The scheduler has no weights to measure, so the worker plans with the same figure and
    checks it against the pages a level really frees (:func:`check_planned_layer`)."""
    if configured:
        return configured
    model_config = vllm_config.model_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    return decoder_layer_bytes(model_config.hf_config, dtype_bytes(model_config.dtype)) // tp


def check_planned_layer(planned_bytes: int, real_bytes: int, page_size: int) -> int:
    """A level may promise the KV cache only the pages it frees: the planned layer must not
    span more pages than the real one. Returns the pages a level frees beyond the plan."""
    planned, real = -(-planned_bytes // page_size), -(-real_bytes // page_size)
    if planned > real:
        raise ValueError(
            f"the KV tiers are planned for layers of {planned} pages ({planned_bytes} bytes) "
            f"but a decoder layer's matrices fill {real} pages ({real_bytes} bytes); set "
            f'"layer_bytes": {real_bytes} in the dynamic_offload config'
        )
    return real - planned


def layout_strides(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """Bytes one block occupies in each distinct KV buffer (packed layouts count once)."""
    strides: list[int] = []
    packed = False
    for tensor in kv_cache_config.kv_cache_tensors:
        if getattr(tensor, "block_stride", 0):
            if not packed:
                strides.append(tensor.block_stride)
                packed = True
        else:
            strides.append(tensor.size // kv_cache_config.num_blocks)
    if not strides:
        raise ValueError("the KV cache config has no tensors")
    return tuple(strides)


def recover_plan(
    kv_cache_config: KVCacheConfig, layer_bytes: int, max_level: int, page_size: int
) -> tuple[CapacityPlan, KVLayout]:
    """Scheduler side: the plan the worker sized ``kv_cache_config`` for."""
    strides = layout_strides(kv_cache_config)
    probe = plan_capacity(strides, 1 << 62, layer_bytes, max_level, page_size)
    total_groups = kv_cache_config.num_blocks // probe.group_blocks
    tiers = probe.groups_at(max_level) - probe.groups_at(0)
    base_groups = total_groups - tiers
    if base_groups < 1:
        raise ValueError(
            f"the KV cache ({kv_cache_config.num_blocks} blocks) is too small for "
            f"{max_level} levels ({tiers} groups); was the worker started with "
            "the dynamic-offload --worker-cls?"
        )
    plan = dataclasses.replace(probe, base_groups=base_groups)
    return plan, KVLayout(kv_cache_config.num_blocks, strides, page_size)
