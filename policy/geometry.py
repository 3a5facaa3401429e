"""Sizes both sides must agree on: a decoder layer's bytes, the KV layout, the tier plan.

The worker sizes the KV tensors for ``plan_capacity(...).num_blocks`` (the highest level's
capacity) and the scheduler recovers the same plan from the resulting ``KVCacheConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheTensor

from dynoff.policy.block_pool import CapacityPlan, KVLayout, plan_capacity
from dynoff.policy.messages import PlanReport


class UnsupportedModelError(ValueError):
    """A model whose layers the capacity plan does not model."""


# hf config keys that count a mixture-of-experts layer's experts (Mixtral, Qwen-MoE, DeepSeek)
MOE_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def refuse_unmodelled(hf_config: Any) -> None:
    """Refuse architectures whose decoder layers :func:`decoder_layer_bytes` does not model:
    with experts, the plan would promise the KV cache pages no level frees, or waste most
    of what it does, and the expert kernels have not run over VMM pages."""
    text = getattr(hf_config, "text_config", None) or hf_config
    for key in MOE_EXPERT_KEYS:
        experts = getattr(text, key, None)
        if isinstance(experts, int) and experts > 1:
            raise UnsupportedModelError(
                f"dynamic offload plans its KV tiers for dense decoder layers; "
                f"{getattr(text, 'model_type', type(text).__name__)} is a mixture-of-experts "
                f"model ({key}={experts}), which it does not support yet: serve this model "
                "without the plugin (drop --worker-cls, --scheduler-cls and the "
                "dynamic_offload config)"
            )


def decoder_layer_bytes(hf_config: Any, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of one dense decoder layer's pack on one of ``tp`` tensor-parallel ranks
    (Llama / Qwen / Mistral families): its matrices, the attention projections and the
    gated MLP, split as vLLM splits them (KV heads are replicated when there are fewer of
    them than ranks). Its vectors (norms, biases) stay resident outside the pack
    (``compile_pass.placement.packed_parameters``)."""
    refuse_unmodelled(hf_config)
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    inter = text.intermediate_size
    rank_heads, rank_kv_heads = heads // tp, max(1, kv_heads // tp)
    params = hidden * head_dim * (2 * rank_heads + 2 * rank_kv_heads)  # q, o, k, v
    params += 3 * hidden * (inter // tp)  # gate, up, down
    return params * dtype_bytes


def dtype_bytes(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2


def planned_layer_bytes(vllm_config: Any, configured: int | None) -> int:
    """The layer size both sides plan the KV tiers with: ``layer_bytes`` if the user set it,
    else :func:`decoder_layer_bytes` of the model's config on one tensor-parallel rank.
    The scheduler has no weights to measure, so the worker plans with the same figure,
    checks it against the pages a level really frees (:func:`check_planned_layer`) and
    reports its plan, which the scheduler checks against its own
    (:func:`check_worker_plans`). Mixture-of-experts models are refused either way."""
    model_config = vllm_config.model_config
    refuse_unmodelled(model_config.hf_config)
    if configured:
        return configured
    tp = vllm_config.parallel_config.tensor_parallel_size
    return decoder_layer_bytes(model_config.hf_config, dtype_bytes(model_config.dtype), tp)


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


class PlanMismatchError(RuntimeError):
    """A worker maps a different KV capacity plan than the scheduler hands out blocks by."""


def plan_report(
    rank: int, plan: CapacityPlan, layout: KVLayout, kv_layout: str, real_layer_pages: int
) -> PlanReport:
    """What a worker reports of the plan it maps (on its first step)."""
    return PlanReport(
        rank=rank,
        kv_layout=kv_layout,
        page_size=layout.page_size,
        num_blocks=layout.num_blocks,
        group_blocks=plan.group_blocks,
        base_groups=plan.base_groups,
        max_level=plan.max_level,
        layer_pages=plan.layer_pages,
        pages_per_group=plan.pages_per_group,
        real_layer_pages=real_layer_pages,
    )


def check_worker_plans(mine: PlanReport, reports: Sequence[PlanReport]) -> None:
    """The scheduler's check of every rank's plan against its own (``mine``, whose
    ``real_layer_pages`` it cannot know). Blocks the scheduler hands out must sit on pages
    every worker mapped, and a level must free at least the pages it promises, else a KV
    write lands on the read-only zero page and kills the CUDA context."""
    problems = []
    for report in reports:
        theirs = dataclasses.replace(report, rank=mine.rank, real_layer_pages=mine.real_layer_pages)
        if theirs != mine:
            diff = {
                f.name: (getattr(mine, f.name), getattr(theirs, f.name))
                for f in dataclasses.fields(mine)
                if getattr(mine, f.name) != getattr(theirs, f.name)
            }
            problems.append(f"rank {report.rank} maps {diff} (scheduler, worker)")
        if report.real_layer_pages < report.layer_pages:
            problems.append(
                f"rank {report.rank}: a level frees {report.real_layer_pages} pages but the "
                f"plan promises {report.layer_pages}"
            )
    if problems:
        raise PlanMismatchError(
            "dynamic offload: the workers' KV capacity plan differs from the scheduler's: "
            + "; ".join(problems)
            + ". Start vllm serve with the plugin's --worker-cls and --scheduler-cls from the "
            'same installation; if they are, set "layer_bytes" in the dynamic_offload config '
            "to the bytes the worker log reports for a decoder layer, and report the mismatch"
        )


# -- the packed layout: KV and weights on large pages -------------------------------------------

GRANULE = 2 << 20  # CUDA's VMM allocation granularity (and the default page)
MAX_PAGE = 64 << 20  # a 128 MiB handle costs what a 2 MiB one does per call; groups grow with it
TARGET_LAYER_PAGES = 32  # ~64 mappings a change, ~3.5 ms in the driver on the H200


def choose_page_size(layer_bytes: int, block_bytes: int, granule: int = GRANULE) -> int:
    """The page (one physical handle) that the weights and the packed KV tiers move on.

    The driver charges per mapping (about 55 µs for unmap and access together on the H200,
    whatever the handle's size), so a level change costs about two mappings per page a layer
    spans. The page must divide the layer's granule-rounded pack exactly, else every layer's
    pack grows and level 0 holds less KV than stock. A group (``lcm(page, block)`` bytes)
    is the reclaim unit and what level 0 may lose to rounding, so among the pages that bring
    a layer to at most :data:`TARGET_LAYER_PAGES` the one with the smallest group wins;
    where none does, the fewest pages a layer.
    """
    granules = -(-layer_bytes // granule)
    candidates = []
    for m in range(1, MAX_PAGE // granule + 1):
        page = m * granule
        group = math.lcm(page, block_bytes)
        if granules % m == 0 and group <= granules * granule:
            candidates.append((granules // m, group, page))
    within = [c for c in candidates if c[0] <= TARGET_LAYER_PAGES]
    if within:
        return min(within, key=lambda c: (c[1], c[0]))[2]
    return min(candidates, key=lambda c: (c[0], c[1]))[2] if candidates else granule


def uses_v2_runner(vllm_config: Any) -> bool:
    """vLLM's V2 model runner (``vllm/v1/worker/gpu/``): 0.26's default for Qwen3 and Llama
    on CUDA; the CPU engine always runs the V1 runner."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def packed_refusal(specs: Sequence[Any], on_cpu: bool, v2_runner: bool) -> str | None:
    """Why vLLM's packed KV layout does not apply here, or None where it does. ``specs`` are
    the KV cache specs (the worker's per layer, the scheduler's per group): one kind of
    attention spec whose backend indexes the KV cache by its block stride."""
    if on_cpu:
        return "needs CUDA and vLLM's V2 model runner; vLLM's CPU engine runs the V1 runner"
    if not v2_runner:
        return (
            "needs vLLM's V2 model runner (its KV allocation reads the packed layout); the V1 "
            "runner is in use here (VLLM_USE_V2_MODEL_RUNNER=0 or a model V2 does not run)"
        )
    kinds = set(specs)
    if len(kinds) != 1:
        return (
            f"needs one KV cache group; this model has {len(kinds)} kinds of KV cache "
            "(sliding-window or hybrid attention)"
        )
    (spec,) = kinds
    if not isinstance(spec, AttentionSpec) or not spec.indexes_kv_by_block_stride:
        return (
            "needs an attention backend that indexes the KV cache by its block stride "
            f"(num_blocks outermost); {type(spec).__name__} here does not"
        )
    return None


def resolve_kv_layout(
    requested: str, specs: Sequence[Any], on_cpu: bool, v2_runner: bool
) -> tuple[str, str]:
    """(``"packed"`` or ``"per_layer"``, why) for the configured ``kv_layout``. ``"auto"``
    takes the packed layout wherever it applies: ~15x fewer driver calls per level change
    (``bench/results/vmm_page_size_h200.json``), token-identical on the H200
    (``bench/results/e2e_packed/``). An explicit ``"packed"`` that does not apply is refused
    with the reason; the worker and the scheduler resolve it the same way."""
    if requested == "per_layer":
        return "per_layer", "configured"
    refusal = packed_refusal(specs, on_cpu, v2_runner)
    if refusal is None:
        return "packed", "configured" if requested == "packed" else "auto: it applies here"
    if requested == "packed":
        raise ValueError(f'kv_layout "packed" {refusal}: use "auto" or "per_layer"')
    return "per_layer", f"auto: the packed layout {refusal}"


def packed_kv_cache_config(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """``kv_cache_config`` in vLLM's packed layout: one buffer in which a block's bytes of
    every layer sit side by side (``KVCacheTensor.offset`` / ``block_stride``, which vLLM's
    V2 runner views per layer), the same blocks and bytes. The worker and the scheduler both
    derive it, so they plan the same groups. Refused, with the reason, where the layout does
    not apply."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f'kv_layout "packed" needs one KV cache group; this model has {len(groups)} '
            '(sliding-window or hybrid attention): use "per_layer"'
        )
    refusal = packed_refusal([groups[0].kv_cache_spec], on_cpu=False, v2_runner=True)
    if refusal is not None:
        raise ValueError(f'kv_layout "packed" {refusal}: use "per_layer"')
    tensors = kv_cache_config.kv_cache_tensors
    if any(t.block_stride for t in tensors):
        return kv_cache_config
    num_blocks = kv_cache_config.num_blocks
    sizes = [t.size // num_blocks for t in tensors]
    stride = sum(sizes)
    packed, offset = [], 0
    for tensor, size in zip(tensors, sizes, strict=True):
        packed.append(
            KVCacheTensor(
                size=stride * num_blocks,
                shared_by=list(tensor.shared_by),
                offset=offset,
                block_stride=stride,
            )
        )
        offset += size
    return dataclasses.replace(kv_cache_config, kv_cache_tensors=packed)
