"""The capacity geometry, which both sides must agree on: the page, a decoder layer's bytes,
how blocks sit in the KV tensors (:class:`KVLayout`), the groups each level holds
(:class:`CapacityPlan`, :func:`plan_capacity`) and the packed KV layout.

The worker sizes the KV tensors for ``plan_capacity(...).num_blocks`` (the highest level's
capacity), the scheduler recovers the same plan from the resulting ``KVCacheConfig``
(:func:`recover_plan`), and each rank reports the plan it maps, which the scheduler checks
against its own (:func:`check_worker_plans`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from dynoff.policy.messages import PlanReport

GRANULE = 2 << 20  # CUDA's VMM allocation granularity: the default page, the host backend's too
# PyTorch's caching allocator reserves an allocation over 10 MiB in whole 2 MiB units: what
# stock vLLM's KV tensors really occupy (c10/cuda/CUDACachingAllocator.cpp, kRoundLarge).
TORCH_ROUND_LARGE = 2 << 20
TORCH_LARGE_BUFFER = 10 << 20


def torch_reserved(nbytes: int) -> int:
    """Bytes the caching allocator reserves for one allocation of ``nbytes`` (large ones)."""
    if nbytes <= TORCH_LARGE_BUFFER:
        return nbytes
    return -(-nbytes // TORCH_ROUND_LARGE) * TORCH_ROUND_LARGE


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How blocks sit in the KV tensors.

    Attributes:
        num_blocks: blocks the BlockPool holds (capacity at the highest level).
        block_bytes: bytes one block occupies in each KV tensor (its stride there).
        page_size: VMM page size in bytes.
    """

    num_blocks: int
    block_bytes: tuple[int, ...]
    page_size: int = GRANULE

    def __post_init__(self) -> None:
        if not self.block_bytes or min(self.block_bytes) <= 0:
            raise ValueError("block_bytes needs one positive stride per KV tensor")

    @property
    def group_blocks(self) -> int:
        return math.lcm(*(self.page_size // math.gcd(self.page_size, b) for b in self.block_bytes))

    @property
    def num_groups(self) -> int:
        return self.num_blocks // self.group_blocks

    @property
    def pages_per_group(self) -> int:
        return sum(self.group_blocks * b // self.page_size for b in self.block_bytes)

    def blocks_of(self, group: int) -> range:
        g = self.group_blocks
        return range(group * g, (group + 1) * g)

    def page_span(self, group: int, tensor: int) -> range:
        """Pages of KV tensor ``tensor`` that group ``group`` occupies."""
        per = self.group_blocks * self.block_bytes[tensor] // self.page_size
        return range(group * per, (group + 1) * per)


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """Groups per level: ``base_groups`` at k = 0, then the groups the freed layers' pages fill.

    Each level frees ``layer_pages`` pages and a group takes ``pages_per_group``. Pages a
    level frees beyond its whole groups are not lost: they wait in the pool for the next
    level's, so level k holds ``base_groups + (k * layer_pages) // pages_per_group`` groups
    and a change between two levels maps or unmaps :meth:`tier` groups (which may differ by
    one from level to level).
    """

    group_blocks: int
    base_groups: int
    max_level: int
    layer_pages: int
    pages_per_group: int

    def __post_init__(self) -> None:
        if min(self.group_blocks, self.layer_pages, self.pages_per_group) < 1:
            raise ValueError(f"a capacity plan needs positive sizes, not {self}")

    @property
    def num_blocks(self) -> int:
        return self.groups_at(self.max_level) * self.group_blocks

    def groups_at(self, level: int) -> int:
        return self.base_groups + (level * self.layer_pages) // self.pages_per_group

    def tier(self, level: int) -> int:
        """Groups mapped going from ``level`` to ``level + 1`` (unmapped coming back)."""
        return self.groups_at(level + 1) - self.groups_at(level)

    def capacity_blocks(self, level: int) -> int:
        """C_k: blocks at level k, the null block included."""
        return self.groups_at(level) * self.group_blocks


def plan_capacity(
    block_bytes: Sequence[int],
    base_blocks: int,
    layer_bytes: int,
    max_level: int,
    page_size: int = GRANULE,
    stock_block_bytes: Sequence[int] | None = None,
) -> CapacityPlan:
    """Tiers for a model: each level frees one layer's pages, which fill whole groups (the
    remainder carried to the next level, :class:`CapacityPlan`).

    Level 0 gets the ``base_blocks`` vLLM sized, in whole groups: rounded up when the blocks
    that completes the last group take no more than what stock vLLM's own KV tensors (one
    per layer, of ``stock_block_bytes`` a block; by default ``block_bytes``) reserve beyond
    ``base_blocks`` in PyTorch's rounding (:func:`torch_reserved`), so level 0 holds no
    fewer blocks than stock with no more memory, whatever the plugin's own layout; rounded
    down otherwise."""
    probe = KVLayout(num_blocks=0, block_bytes=tuple(block_bytes), page_size=page_size)
    layer_pages = -(-layer_bytes // page_size)
    base_groups = base_blocks // probe.group_blocks
    up = (base_groups + 1) * probe.group_blocks
    stock = tuple(stock_block_bytes or block_bytes)
    slack = sum(torch_reserved(base_blocks * b) - base_blocks * b for b in stock)
    needed = (up - base_blocks) * sum(probe.block_bytes)
    if (
        base_blocks % probe.group_blocks
        and all(base_blocks * b > TORCH_LARGE_BUFFER for b in stock)
        and needed <= slack
    ):
        base_groups += 1
    if base_groups < 1:
        raise ValueError(
            f"{base_blocks} KV blocks at level 0 do not fill one group of "
            f"{probe.group_blocks} blocks; give the KV cache more memory"
        )
    if max_level > 0 and layer_pages < probe.pages_per_group:
        raise ValueError(
            f"one layer ({layer_pages} pages) frees less than one KV group "
            f"({probe.pages_per_group} pages, one in each KV tensor): offloading would not "
            "grow the KV cache; a model this small gains nothing from offloading, so serve "
            "it without the plugin's flags"
        )
    return CapacityPlan(
        probe.group_blocks, base_groups, max_level, layer_pages, probe.pages_per_group
    )


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


def per_layer_kv_cache_config(num_blocks: int, spec: Any, num_layers: int) -> KVCacheConfig:
    """vLLM's KV cache config for ``num_layers`` attention layers of one kind (``spec``), one
    tensor per layer, as its engine builds it: what the simulator's scheduler and the tests
    stand on."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


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
        levels = {r.max_level for r in reports} - {mine.max_level}
        hint = (
            f". The workers fitted max level {min(levels)} to their host memory and the "
            "scheduler could not read it (their rank 0 on another host): set "
            f'"policy": {{"max_level": {min(levels)}}}'
            if levels and min(levels) < mine.max_level
            else ""
        )
        raise PlanMismatchError(
            "dynamic offload: the workers' KV capacity plan differs from the scheduler's: "
            + "; ".join(problems)
            + hint
            + ". Start vllm serve with the plugin's --worker-cls and --scheduler-cls from the "
            'same installation; if they are, set "layer_bytes" in the dynamic_offload config '
            "to the bytes the worker log reports for a decoder layer, and report the mismatch"
        )


# -- the packed layout: KV and weights on large pages -------------------------------------------

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
