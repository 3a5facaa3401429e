"""A serving simulator made of vLLM's real scheduler (the fast-link issue, item 4; first
version): vLLM's own ``AsyncScheduler`` (stock) or the plugin's ``DynamicOffloadScheduler``
(its policy, its elastic pool over vLLM's ``BlockPool``) runs in process on the CPU against
a simulated clock. Admission, chunked prefill, preemption and prefix caching are vLLM's own,
and so is the engine's loop (two steps in flight under async scheduling, as
``EngineCore.step_with_batch_queue`` runs them); only the model's forward is replaced, by a
step-time model.

    python -m bench.simulator --system plugin --trace trace.jsonl --out sim.json \\
        [--link-GBps 390] [--kv-blocks 6095] [--model tests/models/qwen3-32b]
    python -m bench.simulator --check-steps RUN.json.gz [--machine h100] [--link-GBps 390] \
        --out check.json    # the step model against a plugin serving run's timed steps

The plugin's scheduler gets, on its first report, the calibration its workers would
measure on that machine (:meth:`StepModel.calibration`), as in serving. Each step's
duration comes from :class:`StepModel`: the plugin's own cost model
(:class:`~dynoff.policy.latency.OffloadCostModel`: per-layer compute by batch composition,
each offloaded layer's copy at the link's bandwidth and how much of it hides, the piecewise
penalty while k > 0) plus the stall of a level change. Its defaults are the H200's
(Qwen3-32B, bf16): the start-up calibration's decode steps (FULL at batch 8 / 64 / 256:
19.4 / 20.8 / 33.3 ms), the microbenchmark's prefill (1,714 ms for 16,384 tokens), a 0.81 ms
piecewise penalty, 55.3 GB/s, and level changes of 5.1 ms up and 6.0 ms down under load.
With ``--kv-offloading-size GiB``, vLLM's CPU KV offloading runs as in serving: its
``OffloadingConnector``'s scheduler half is vLLM's own, and its worker half's copies are
simulated (:class:`KVTierLink`: stores and loads at the host link's bandwidth, loads sharing
it with the plugin's weight copies). Prompts are built from the trace's ``hash_ids`` as
``vllm bench serve`` builds them, so doc QA's documents are shared prefixes here too, and
the result gives vLLM's prefix-cache hit rates, GPU and CPU tier.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.traces import CHUNK

GIB = 1 << 30
MAX_IDLE_STEPS = 10_000  # steps in a row that schedule nothing: the simulation is stuck
ROOT = Path(__file__).parents[1]


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Step time (ms) from a step's composition, the level and the link."""

    num_layers: int = 64
    layer_bytes: int = 975_196_672
    link_GBps: float = 55.3
    intercept_ms: float = 18.6
    ms_per_decode_token: float = 0.057
    ms_per_prefill_token: float = 0.1008  # with the pair price and the share: below
    piecewise_penalty_ms: float = 0.81
    stall_up_ms: float = 5.1
    stall_down_ms: float = 6.0
    lock_ms: float = 0.0  # a level's first entry: its two homes page-locked (first_raise)
    # Attention reads every decoding request's KV, which the calibration's short-context
    # decode steps did not: a token of context costs its KV bytes (64 layers x K, V x 8
    # heads x 128 x 2 B = 256 KiB for Qwen3-32B) at the H200's HBM bandwidth (~4.0 TB/s).
    ms_per_context_token: float = 262_144 / 4.0e12 * 1e3
    # A prefill chunk's attention over the prompt before it and itself, per (query, key) pair
    # (:func:`~dynoff.policy.latency.prefill_pairs`).
    ms_per_prefill_pair: float = 3.49e-6
    # A step is a roofline, not a sum: a ShareGPT chunk of a few dozen tokens beside a
    # decode batch costs almost nothing, a chunk of thousands its tokens' FLOPs.
    # ``fixed_share`` of the intercept is outside the roofline (launches, sampling); the rest
    # is the weights' reads. A step with prefill takes the fixed part plus the larger of its
    # memory-bound time (a prefill token priced as a decode token) and its compute-bound
    # time (the prefill price for every token of the batch); decode-only steps are the
    # calibrated line. 1.0 is the sum (the prefill priced on top of the decode step).
    #
    # The three prefill figures are fitted together (:func:`fit_prefill`) on an H100 SXM's
    # Qwen3-32B (``results/prefill_h100/fit_roofline_h100.json``: 24k and 40k-token prompts
    # and a serving run's ShareGPT and long prompts, 225 level-0 mixed steps, with that
    # server's decode calibration): a share of 0.225, 0.0948 ms a token, 3.28e-6 ms a pair.
    # The share is kept; the H200's prefill over the H100's (its microbenchmark, 1,714.5 ms
    # for 8 prompts of 2,048 tokens, against 1,613.5 ms the H100's fit gives them: 1.063x)
    # scales the pair; the token price is what is left of the 1,714.5 ms beside its
    # 16.8 M pairs and the fixed part: (1,714.5 - 58.5 - 0.225 x 18.6) / 16,384 = 0.1008.
    fixed_share: float = 0.225
    # What a step at k > 0 costs beyond the cost model: the copies' contention with compute
    # and the piecewise path at large batches, which the model leaves out. A server's
    # calibration measures it (its level-1 decode steps against the model fitted to its
    # level-0 ones: the policy's :func:`~dynoff.policy.pricing.model_error`, 3.4% on the
    # H100 of 2026-12-07); ``--calibration`` takes it, and every simulated step at k > 0
    # pays it, as the calibration's level-1 steps do, so the simulated policy prices its
    # first climb with the margin the real one had. 0 without a calibration.
    level_excess: float = 0.0

    def compute_bound(self, decode: int, prefill: int, price: float) -> tuple[int, float] | None:
        """Where a step with prefill sits on the roofline at token price ``price``: None on
        its memory-bound side (the prefill costs a decode token's price a token), else
        ``(tokens, ms)`` with its time beyond the decode part ``price x tokens - ms``: the
        batch's compute over the weights' reads, or, when the decode part alone was
        compute-bound already, the prefill's own tokens."""
        memory = (1.0 - self.fixed_share) * self.intercept_ms + self.ms_per_decode_token * decode
        tokens, less = (decode + prefill, memory) if memory >= price * decode else (prefill, 0.0)
        if price * tokens - less <= self.ms_per_decode_token * prefill:
            return None
        return tokens, less

    def priced_shape(self, shape: Any) -> Any:
        """``shape`` with the prefill tokens the roofline charges at the prefill price: the
        step's time beyond its decode part, over that price (the cost model stays linear,
        so a level's copies hide behind the layers' real length)."""
        decode, prefill, context = shape
        price = self.ms_per_prefill_token
        if not prefill or price <= 0 or self.fixed_share >= 1.0:
            return shape
        bound = self.compute_bound(decode, prefill, price)
        if bound is None:
            beyond = self.ms_per_decode_token * prefill
        else:
            beyond = price * bound[0] - bound[1]
        return type(shape)(decode, beyond / price, context)

    def step_ms(self, cost: Any, level: int, shape: Any, pairs: int = 0) -> float:
        """A step's forward at ``level`` (``cost``: this model's :meth:`cost_model`)."""
        forward = cost.step_ms(level, self.priced_shape(shape)) + self.ms_per_prefill_pair * pairs
        return forward * (1.0 + self.level_excess) if level > 0 else forward

    def calibration(self) -> Any:
        """What the workers' start-up calibration would measure on this machine."""
        from dynoff.policy.latency import StepShape
        from dynoff.policy.messages import Calibration

        cost = self.cost_model()
        rows = []
        for batch in (8, 64, 256):
            full = cost.step_ms(0, StepShape(batch, 0))
            rows.append(
                (
                    batch,
                    full,
                    full + self.piecewise_penalty_ms,
                    cost.step_ms(1, StepShape(batch, 0)) * (1.0 + self.level_excess),
                )
            )
        return Calibration(
            h2d_GBps=self.link_GBps,
            layer_copy_ms=self.layer_bytes / (self.link_GBps * 1e9) * 1e3,
            piecewise_penalty_ms=self.piecewise_penalty_ms,
            decode_steps=tuple(rows),
            stall_up_ms=self.stall_up_ms,
            stall_down_ms=self.stall_down_ms,
            lock_ms=self.lock_ms,
        )

    def cost_model(self) -> Any:
        from dynoff.policy.latency import OffloadCostModel, StepCost

        cost = StepCost(
            self.intercept_ms,
            self.ms_per_decode_token,
            self.ms_per_prefill_token,
            self.ms_per_context_token,
        )
        return OffloadCostModel.from_step_cost(
            self.num_layers,
            self.layer_bytes,
            self.link_GBps * 1e9,
            cost,
            piecewise_penalty_ms=self.piecewise_penalty_ms,
        )


@dataclasses.dataclass(frozen=True)
class Machine:
    """One GPU of a machine, as the scaled step model sees it."""

    memory_bytes: float  # as the driver reports it
    hbm_TBps: float
    bf16_TFLOPs: float  # dense
    link_GBps: float  # host <-> this GPU
    nvlink_GBps: float = 450.0  # GPU <-> GPU, one direction (tensor-parallel all-reduces)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the scaled step model needs of a model (``config_dir`` for vLLM's scheduler)."""

    config_dir: str
    num_layers: int
    params: float
    decoder_weight_bytes: float  # as served (fp8: a byte per parameter)
    other_weight_bytes: float  # embeddings, lm_head, norms
    kv_bytes_per_token: int  # every layer, every KV head, bf16
    hidden: int
    fp8: bool = False
    # Mixture of experts: ``params`` are those a token multiplies (its experts), the weight
    # bytes every expert's (a decode batch touches them all). The plugin refuses MoE models
    # in serving; the simulator plans the KV tiers for the MoE layer's bytes on a dense
    # stand-in of its config (:func:`build_scheduler`), and says so in its results.
    moe: bool = False


MACHINES = {
    # The H200's and the H100's memory as their drivers report it to vLLM ("Free memory on
    # device (139.29/139.8 GiB)", "(78.66/79.18 GiB)" in the servers' logs).
    "h200": Machine(139.8 * GIB, 4.8, 989.0, 55.3),
    "h100": Machine(79.18 * GIB, 3.35, 989.0, 55.3),  # 80 GB HBM3, PCIe Gen5
    "gh200": Machine(102.6e9, 4.0, 989.0, 392.0),  # 96 GB HBM3; NVLink-C2C as the seed measured
    "gb200": Machine(198.7e9, 8.0, 2250.0, 900.0),
}
MODELS = {
    "qwen3-32b": ServedModel("tests/models/qwen3-32b", 64, 32.76e9, 62.41e9, 3.11e9, 262_144, 5120),
    "qwen3-8b": ServedModel("tests/models/qwen3-8b", 36, 8.19e9, 13.89e9, 2.49e9, 147_456, 4096),
    "llama-3.1-70b-fp8": ServedModel(
        "tests/models/llama-3.1-70b", 80, 70.55e9, 68.45e9, 4.20e9, 327_680, 8192, fp8=True
    ),
    # 56 layers of attention (88.1M) and 8 experts of 302M (2 active), bf16; 32,768 vocab
    "mixtral-8x22b": ServedModel(
        "tests/models/mixtral-8x22b", 56, 39.2e9, 280.4e9, 0.81e9, 229_376, 6144, moe=True
    ),
}
# The reference every other (machine, model, TP) is scaled from: the H200's Qwen3-32B.
REFERENCE = StepModel()
# What vLLM's profile takes beside the weights and the KV (Qwen3-32B, a compiled graph: 1.61
# GiB of peak activation and 0.22 GiB of non-torch memory on the H200 and the H100 alike),
# fitted to stock's 6,095 blocks at 0.62 on the H200. Held out: stock's 3,162 blocks at 0.95
# and 1,135 at 0.85 on an H100 (3,163 and 1,136 here), Qwen3-8B's 46,306 at 0.85 on the H200
# (46,298). (2.1e9 with the H200 at 150.3e9 bytes before 2026-12-07 fitted the H200's point
# as well and put the H100's 32 blocks short: 3,130 at 0.95.)
RESERVED_BYTES = 1.845 * GIB


def scaled_step_model(
    machine: Machine, model: ServedModel, tp: int = 1, link_GBps: float | None = None
) -> StepModel:
    """A **scaled** step model (no calibration of its own): the H200's Qwen3-32B figures,
    with the step's fixed part scaled by the weight bytes a GPU reads over its HBM bandwidth,
    the per-token parts by the parameters a GPU multiplies over its FLOPs (fp8: twice as
    fast), attention's reads by the KV bytes a GPU holds per token, and, with TP > 1, two
    all-reduces per layer (12 us each, plus each token's hidden state over NVLink). The
    piecewise penalty scales with the layer count, a change's stall with a layer's bytes
    on a GPU (its pages), a prefill pair's attention with the layers times the hidden size
    over the FLOPs."""
    ref, qwen = REFERENCE, MODELS["qwen3-32b"]
    h200 = MACHINES["h200"]
    weights = (model.decoder_weight_bytes + model.other_weight_bytes) / tp
    ref_weights = qwen.decoder_weight_bytes + qwen.other_weight_bytes
    flops = (model.params / tp) / qwen.params * (h200.bf16_TFLOPs / machine.bf16_TFLOPs)
    if model.fp8:
        flops /= 2
    allreduce_ms = 2 * model.num_layers * 0.012 if tp > 1 else 0.0
    per_token_comm = (
        2 * model.num_layers * model.hidden * 2 / (machine.nvlink_GBps * 1e9) * 1e3
        if tp > 1
        else 0.0
    )
    layer = model.decoder_weight_bytes / model.num_layers / tp
    ref_layer = qwen.decoder_weight_bytes / qwen.num_layers
    return StepModel(
        num_layers=model.num_layers,
        layer_bytes=int(layer),
        link_GBps=machine.link_GBps if link_GBps is None else link_GBps,
        intercept_ms=ref.intercept_ms * weights / ref_weights * h200.hbm_TBps / machine.hbm_TBps
        + allreduce_ms,
        ms_per_decode_token=ref.ms_per_decode_token * flops + per_token_comm,
        ms_per_prefill_token=ref.ms_per_prefill_token * flops + per_token_comm,
        piecewise_penalty_ms=ref.piecewise_penalty_ms * model.num_layers / qwen.num_layers,
        stall_up_ms=ref.stall_up_ms * layer / ref_layer,
        stall_down_ms=ref.stall_down_ms * layer / ref_layer,
        ms_per_context_token=model.kv_bytes_per_token / tp / (machine.hbm_TBps * 0.833e12) * 1e3,
        # a pair's attention: layers x query width (about the hidden size), bf16 FLOPs
        ms_per_prefill_pair=ref.ms_per_prefill_pair
        * (model.num_layers * model.hidden)
        / (qwen.num_layers * qwen.hidden)
        / tp
        * h200.bf16_TFLOPs
        / machine.bf16_TFLOPs,
    )


def stock_kv_blocks(machine: Machine, model: ServedModel, tp: int, utilization: float) -> int:
    """The KV blocks (16 tokens) stock vLLM gets on each GPU at ``utilization``."""
    weights = (model.decoder_weight_bytes + model.other_weight_bytes) / tp
    free = utilization * machine.memory_bytes - weights - RESERVED_BYTES
    block = 16 * model.kv_bytes_per_token / tp
    if free < block:
        raise ValueError(f"no KV at {utilization}: the weights need {weights / 1e9:.1f} GB a GPU")
    return int(free // block)


# Page-locked host memory costs device memory: the driver's page tables for it, 2 MiB per GiB
# with 4 KiB host pages (``bench.pinned_cost``'s ``register_4k`` on the H100 and the H200,
# ``bench/results/pinned_cost_h{100,200}.json``), taken by vLLM's profile from the KV cache
# when the homes are locked before it (``pin_homes: "start"``; the default, "first_raise",
# locks a level's homes at its first entry, after the profile).
PAGE_TABLE_BYTES_PER_GIB = 2 * 2**20


# ``cudaHostRegister`` of written host memory (``bench.pinned_cost``'s ``register_4k`` on an
# H100, ``bench/results/pinned_late_h100.json``): a level's first entry waits for its two
# homes' lock under ``pin_homes: "first_raise"``.
LOCK_MS_PER_GIB = 63.6


def pin_homes_of(config: dict[str, Any]) -> str | None:
    """When the plugin page-locks its homes (``"start"``, ``"first_raise"``), or None where
    they are on the device."""
    from dynoff.policy.config import DynamicOffloadConfig

    if config.get("home", DynamicOffloadConfig.home) != "host":
        return None
    return str(config.get("pin_homes", DynamicOffloadConfig.pin_homes))


def homes_device_bytes(config: dict[str, Any], max_level: int, layer_bytes: int) -> int:
    """The device memory the plugin holds before vLLM's profile beyond stock's: the arena's
    zero page, and the page tables of the homes page-locked at start-up (two layers a level
    up to ``max_level``; none where the homes are on the device or are locked at first use)."""
    from dynoff.policy.geometry import GRANULE

    zero_page = GRANULE
    if pin_homes_of(config) != "start":
        return zero_page
    pinned = 2 * max_level * layer_bytes
    return zero_page + -(-pinned * PAGE_TABLE_BYTES_PER_GIB // 2**30)


def build_scheduler(args: argparse.Namespace, model: StepModel) -> Any:
    """vLLM's scheduler for ``args.system`` over the KV cache a worker would size."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from dynoff.policy.geometry import GRANULE, per_layer_kv_cache_config, plan_capacity
    from dynoff.policy.scheduler import DynamicOffloadScheduler

    model_config = ModelConfig(
        model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192
    )
    text = model_config.hf_config
    served = MODELS.get(getattr(args, "served_model", ""))
    if served is not None and served.moe and args.system == "plugin":
        from dynoff.policy.geometry import MOE_EXPERT_KEYS

        for key in MOE_EXPERT_KEYS:  # the dense stand-in: the plan takes layer_bytes below
            if hasattr(text, key):
                setattr(text, key, 1)
    tp = getattr(args, "tp", 1)
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=max(1, text.num_key_value_heads // tp),
        head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        dtype=torch.bfloat16,
    )
    # vLLM's CPU KV offloading (``--kv-offloading-size``): its OffloadingConnector, whose
    # scheduler half runs here as in serving; its copies are simulated (:class:`KVTierLink`).
    cache = CacheConfig(
        block_size=16,
        enable_prefix_caching=True,
        kv_offloading_size=getattr(args, "kv_offloading_size", None),
    )
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=8192,
        is_encoder_decoder=False,
    )
    extra: dict[str, Any] = {}
    num_blocks = args.kv_blocks
    if args.system == "plugin":
        config = json.loads(args.plugin_config)
        # vLLM profiles the plugin's KV after its homes are made: what they hold on the
        # device beyond stock's is not KV (a few blocks: 27 of 3,162 for Qwen3-32B at 0.95
        # on an H100, where the served plugin had 3,135 at level 0).
        held = homes_device_bytes(config, args.max_level, model.layer_bytes)
        block_bytes = spec.page_size_bytes * model.num_layers
        plan = plan_capacity(
            (spec.page_size_bytes,) * model.num_layers,
            args.kv_blocks - -(-held // block_bytes),
            model.layer_bytes,
            args.max_level,
            GRANULE,
        )
        num_blocks = plan.num_blocks
        config.setdefault("policy", {}).setdefault("max_level", args.max_level)
        config.setdefault("host_page_size", GRANULE)
        config.setdefault("layer_bytes", model.layer_bytes)  # fp8 layers are not bf16's
        extra = {"dynamic_offload": config}
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache,
        scheduler_config=sched,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        additional_config=extra,
    )
    cache.num_gpu_blocks = num_blocks
    # As on a GPU (vLLM's CPU platform turns it off): two steps in flight, so with a KV
    # connector a freed block waits for the steps that may still write it, as in serving.
    vllm_config.scheduler_config.async_scheduling = getattr(args, "admission", "async") == "async"
    kv = per_layer_kv_cache_config(num_blocks, spec, model.num_layers)
    cls = DynamicOffloadScheduler if args.system == "plugin" else AsyncScheduler
    return cls(vllm_config, kv, StructuredOutputManager(vllm_config), block_size=16, log_stats=True)


def prompt_tokens(index: int, prompt_len: int, hash_ids: list[int] | None) -> list[int]:
    """The prompt's token ids: from the trace's ``hash_ids`` as ``vllm bench serve`` expands
    them (each id a chunk of 16 tokens of its own, so requests that share ids share that
    prefix: doc QA's documents), else unique to request ``index``."""
    if not hash_ids:
        return [(index * 7919 + j) % 30000 + 3 for j in range(prompt_len)]  # no shared prefix
    tokens: list[int] = []
    for chunk in hash_ids:  # 16 tokens of 16 bits from four splitmix64 draws of the id
        for draw in range(CHUNK // 4):
            bits = _splitmix64(chunk * (CHUNK // 4) + draw)
            tokens += [(bits >> (16 * i)) & 0xFFFF for i in range(4)]
        if len(tokens) >= prompt_len:
            break
    return [t + 3 for t in tokens[:prompt_len]]


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def samples(request: Any) -> bool:
    """Whether the step just scheduled for ``request`` samples a token: once its prompt and
    every output token so far are computed (``num_computed_tokens`` already counts the step
    after ``schedule()``). A request resumed after a preemption recomputes both, and its
    chunks sample nothing until the last."""
    return bool(request.num_computed_tokens >= request.num_tokens)


def context_read(scheduler: Any, out: Any) -> int:
    """The KV tokens a step's attention would read from HBM for its decode requests if each
    cached block came from HBM once, however many of them attend to it (``--kv-reads
    per-block``). Requests that share a prefix (doc QA's documents) share its blocks through
    vLLM's prefix cache, and a layer's shared blocks may be served from L2 after the first
    read. The H100's doc-QA decode steps (2026-12-07, level 0): 25.3 ms at 1-4 requests, 29.0 ms
    at 13-16 and 30.7 ms at 17-32, flat where 4,200 more tokens a request, read apiece,
    would add 1.5 ms each; priced apiece the model was 4-14% slow past 12 requests, priced
    so it makes them fast (``--kv-reads per-block``: the truth lies between)."""
    from dynoff.policy.latency import decode_contexts

    block_size = scheduler.block_size
    blocks: dict[int, int] = {}  # block -> the tokens of it read
    for rid, tokens in decode_contexts(out).items():
        if not tokens:
            continue
        ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
        full, last = divmod(tokens, block_size)
        for block in ids[:full]:
            blocks[block] = block_size
        if last and full < len(ids):
            blocks[ids[full]] = max(blocks.get(ids[full], 0), last)
    return sum(blocks.values())


def make_request(
    index: int, prompt_len: int, output_len: int, hash_ids: list[int] | None = None
) -> Any:
    """Request ``index`` of the trace (the block hasher's none-hash is set up by
    :func:`simulate`, once)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    prompt = prompt_tokens(index, prompt_len, hash_ids)
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(16, sha256),
    )


class KVTierLink:
    """The CPU KV tier's copies, simulated: what the OffloadingConnector's worker half does
    with the jobs its scheduler half (real, in the scheduler) issues. Stores move GPU blocks
    to the host, loads move them back, each direction a queue at the host link's bandwidth.
    Loads share the host-to-GPU direction with the plugin's weight copies, which take
    ``2k`` layers a step at level k (one in, one back): a load moves at the share they
    leave. The worker starts a step's loads when it launches the step, its stores after the
    step's forward, and one the scheduler asks to flush (its block handed out again) before
    the step runs; it reports what has landed when it has launched a step. The connector's
    copies may move slower than the link (``--tier-load-GBps``, ``--tier-store-GBps``):
    vLLM's own transfer metrics gave loads of 35-42 GB/s on an H100's 55 GB/s link under
    stock's per-layer KV tensors and 54 GB/s under the plugin's packed layout."""

    MIN_SHARE = 0.05  # the copy engines interleave: a load never stops outright

    def __init__(self, block_bytes: int, load_GBps: float, store_GBps: float) -> None:
        self.block_bytes = block_bytes
        self.load_bytes_per_s = load_GBps * 1e9
        self.store_bytes_per_s = store_GBps * 1e9
        self.h2d_free = 0.0  # when each direction's queue drains
        self.d2h_free = 0.0
        self.done_at: dict[int, float] = {}  # job id -> when it completes
        self.loads: dict[int, str] = {}  # load job id -> its request
        self.landed: dict[str, float] = {}  # request -> when its loads land
        self.loaded_blocks = 0
        self.stored_blocks = 0

    def _store(self, job_id: int, job: Any, after: float) -> None:
        blocks = len(job.src_spec.block_ids)
        seconds = blocks * self.block_bytes / self.store_bytes_per_s
        self.d2h_free = max(self.d2h_free, after) + seconds
        self.done_at[job_id] = self.d2h_free
        self.stored_blocks += blocks

    def submit(self, meta: Any, launch: float, start: float, h2d_share: float) -> float:
        """Queue a step's loads and the stores it flushes, as the worker does when the
        engine launches the step at ``launch`` (its forward starts on the device at
        ``start``, once the steps before it are done). A load runs on its own stream from
        its submission; a store the scheduler asks to flush (its block handed out again) is
        submitted then, behind the steps before it, and waited for on the host. Returns when
        the flushes are done (``launch`` where there are none)."""
        flush = set(meta.jobs_to_flush or ())
        for job_id in flush & meta.store_jobs.keys():
            self._store(job_id, meta.store_jobs[job_id], start)
        share = max(h2d_share, self.MIN_SHARE)
        for job_id, job in meta.load_jobs.items():
            blocks = len(job.dst_spec.block_ids)
            seconds = blocks * self.block_bytes / (self.load_bytes_per_s * share)
            self.h2d_free = max(self.h2d_free, launch) + seconds
            self.done_at[job_id] = self.h2d_free
            self.loads[job_id] = job.req_id
            self.landed[job.req_id] = self.h2d_free
            self.loaded_blocks += blocks
        return max([launch, *(self.done_at[j] for j in flush if j in self.done_at)])

    def defer_stores(self, meta: Any, after: float) -> None:
        """The step's other stores: the worker defers them to the next step's launch, where
        they wait for the compute stream, so they start once this step's forward (ending at
        ``after``) is done."""
        flush = set(meta.jobs_to_flush or ())
        for job_id, job in meta.store_jobs.items():
            if job_id not in flush:
                self._store(job_id, job, after)

    def collect(self, now: float) -> Any:
        """The connector's output for the jobs complete by ``now`` (None: none). The worker
        polls its copies when it has launched a step (``get_finished`` after the forward is
        enqueued, not done), so a step's output carries what had landed by its launch."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        done = [job for job, at in self.done_at.items() if at <= now]
        if not done:
            return None
        meta = OffloadingWorkerMetadata()
        received = set()
        for job in done:
            del self.done_at[job]
            meta.mark_completed(job)
            if job in self.loads:
                received.add(self.loads.pop(job))
        return KVConnectorOutput(finished_recving=received, kv_connector_worker_meta=meta)

    def next_done(self) -> float | None:
        return min(self.done_at.values(), default=None)


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on the device: what was scheduled, when it ends, what it samples, and the
    level, forward time, change stall and level command it runs with."""

    out: Any
    end: float
    sampled: list[list[int]]
    level: int
    forward: float
    stall: float
    command: Any
    shape: Any
    connector_output: Any  # the CPU tier's copies landed by the step's launch


def simulate(args: argparse.Namespace, model: StepModel, trace: list[dict[str, Any]]) -> dict:
    """Serve ``trace`` (``{"t", "prompt_len", "output_len"}`` per request) on the simulated
    clock; returns the client's view (as ``vllm bench serve`` reports it) and the levels."""
    from tqdm import tqdm
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput

    from dynoff.policy.latency import StepShape, prefill_pairs
    from dynoff.policy.messages import ResizeOutcome, StepReport

    init_none_hash(sha256)
    scheduler = build_scheduler(args, model)
    if (
        args.system == "plugin"
        and not model.lock_ms
        and pin_homes_of(json.loads(args.plugin_config)) == "first_raise"
    ):
        model = dataclasses.replace(model, lock_ms=2 * model.layer_bytes / GIB * LOCK_MS_PER_GIB)
    entered = 1  # the highest level entered (the calibration's level 1 is locked)
    cost = model.cost_model()
    tier = None
    if scheduler.connector is not None:
        kv = scheduler.kv_cache_config
        block_bytes = sum(t.size for t in kv.kv_cache_tensors) // kv.num_blocks
        tier = KVTierLink(
            block_bytes,
            getattr(args, "tier_load_GBps", None) or model.link_GBps,
            getattr(args, "tier_store_GBps", None) or model.link_GBps,
        )
    idle_steps = 0  # steps that scheduled nothing while the CPU tier's copies ran
    launches: list[float] = []  # when the worker launched each step (and polled the tier)
    # a request loaded from the CPU tier: how many launches from its load's landing to the
    # one that schedules it (the first polls the load, the next reads it in the output)
    after_load: collections.Counter[int] = collections.Counter()
    host_s = 0.0  # wall time in the scheduler's schedule() and update_from_output()
    stalled = 0  # consecutive steps that scheduled nothing
    counters = PrefixCounters()
    pending = sorted(trace, key=lambda r: r["t"])
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    outputs: dict[str, int] = {}
    now, nxt, steps, levels = 0.0, 0, 0, [0]
    if args.system == "plugin":  # the audit's rates and the trace's times: simulated time
        scheduler.offload.use_clock(lambda: now)
    made: list[Any] = []  # every request, for its preemption count at the end
    peak_kv = 0.0
    # vLLM's engine loop (``EngineCore.step_with_batch_queue``): under async scheduling (its
    # default, and the plugin's: it subclasses AsyncScheduler) the engine keeps two steps in
    # flight. It schedules step i+1 as soon as step i is launched, and reads step i's output
    # only after that, so step i+1 is scheduled on a state that lacks step i's results: a
    # request finishing in step i frees its blocks a step later, one arriving while step i
    # runs joins step i+2, and with a KV connector a freed block waits for the steps that may
    # still write it. ``now`` is the engine's clock (when it schedules), ``device_free`` when
    # the device finishes the steps launched so far.
    depth = scheduler.vllm_config.max_concurrent_batches  # 2 under async scheduling, else 1
    kv_reads = getattr(args, "kv_reads", "per-request")
    queue: collections.deque[LaunchedStep] = collections.deque()
    device_free = 0.0
    device_level = scheduler.offload.level if args.system == "plugin" else 0
    # Requests finished, in a terminal only (a run of a few thousand requests takes minutes).
    bar = tqdm(total=len(pending), desc=f"{args.system} (simulated)", unit="req", disable=None)
    while nxt < len(pending) or scheduler.has_requests() or queue:
        while nxt < len(pending) and pending[nxt]["t"] <= now:  # the engine's input queue
            r = pending[nxt]
            request = make_request(nxt, r["prompt_len"], r["output_len"], r.get("hash_ids"))
            made.append(request)
            arrival[request.request_id] = r["t"]
            outputs[request.request_id] = r["output_len"]
            scheduler.add_request(request)
            nxt += 1
        if scheduler.has_requests():
            tick = time.perf_counter()
            out = scheduler.schedule()
            host_s += time.perf_counter() - tick
            peak_kv = max(peak_kv, scheduler.kv_cache_manager.usage)
            command = getattr(out, "dynamic_offload", None)
            stall = 0.0
            if command is not None:  # the worker changes level before this step's forward
                up = command.target_level > device_level
                stall = model.stall_up_ms if up else model.stall_down_ms
                device_level = command.target_level
                if device_level > entered:  # its homes page-locked first (first_raise), once
                    stall += model.lock_ms
                    entered = device_level
            # The step as the worker reads it. Attention reads the context inside every
            # layer, so it lengthens the compute that hides the copies (on the emulated link
            # its HBM reads share the copy kernel's).
            shape = StepShape.of(out)
            decode, prefill, context = shape
            pairs = prefill_pairs(out) if prefill and model.ms_per_prefill_pair else 0
            priced = shape
            if decode and kv_reads == "per-block":
                priced = shape._replace(num_context_tokens=context_read(scheduler, out))
            forward = model.step_ms(cost, device_level, priced, pairs) if decode + prefill else 0.0
            start = max(now, device_free)
            poll = now  # when the worker polls the tier's copies: once it has launched the step
            if tier is not None:
                copy_ms = 2 * device_level * model.layer_bytes / (model.link_GBps * 1e9) * 1e3
                share = 1.0 - min(1.0, copy_ms / forward) if forward > 0 else 1.0
                flushed = tier.submit(out.kv_connector_metadata, now, start, share)
                start, poll = max(start, flushed), max(now, flushed)
                if not out.num_scheduled_tokens and not any(
                    s.out.num_scheduled_tokens for s in queue
                ):
                    # nothing runs: the engine polls the tier's copies until one lands
                    idle_steps += 1
                    arrival_t = pending[nxt]["t"] if nxt < len(pending) else None
                    ahead = [t for t in (tier.next_done(), arrival_t) if t is not None]
                    start = poll = max(start, min(ahead, default=start + 1e-3))
            stalled = 0 if out.num_scheduled_tokens else stalled + 1
            if stalled > MAX_IDLE_STEPS:
                raise RuntimeError(
                    f"the simulation made no progress for {stalled} steps at t={now:.3f} s "
                    f"with {len(scheduler.running)} running and "
                    f"{len(scheduler.waiting) + len(scheduler.skipped_waiting)} waiting"
                )
            device_free = start + (forward + stall) / 1e3
            connector_output = None
            if tier is not None:
                tier.defer_stores(out.kv_connector_metadata, device_free)
                connector_output = tier.collect(poll)
                launches.append(max(poll, launches[-1] if launches else poll))
                for rid in out.num_scheduled_tokens:
                    if rid in tier.landed:
                        landed = tier.landed.pop(rid)
                        after_load[len(launches) - bisect.bisect_left(launches, landed)] += 1
            req_ids = list(out.num_scheduled_tokens)
            queue.appendleft(
                LaunchedStep(
                    out,
                    device_free,
                    # what the worker samples is fixed when the step is scheduled
                    [[7] if samples(scheduler.requests[rid]) else [] for rid in req_ids],
                    device_level,
                    forward,
                    stall,
                    command,
                    shape,
                    connector_output,
                )
            )
            if len(queue) < depth and scheduler.has_requests():
                continue  # the queue is not full: schedule the next step at once
        elif not queue:  # idle: the next request starts a step on arrival
            now = max(now, pending[nxt]["t"])
            continue
        step = queue.pop()  # block on the oldest step in flight
        now = max(now, step.end)
        steps += 1
        out = step.out
        req_ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=step.sampled,
            kv_connector_output=step.connector_output,
        )
        if args.system == "plugin":
            outcomes: tuple[ResizeOutcome, ...] = ()
            command = step.command
            if command is not None:  # every tensor-parallel rank answers
                outcomes = tuple(
                    ResizeOutcome(
                        command.command_id, r, True, remap_ms=step.stall, driver_ms=step.stall
                    )
                    for r in range(getattr(args, "tp", 1))
                )
            decode, prefill, context = step.shape
            result.dynamic_offload = StepReport(  # type: ignore[attr-defined]
                steps,
                step.level,
                step.forward,
                decode,
                prefill,
                outcomes,
                calibration=model.calibration() if steps == 1 else None,
                last_command=command.command_id if command is not None else -1,
                level_now=step.level,
                num_context_tokens=context,
            )
        for rid, tokens in zip(req_ids, step.sampled, strict=True):
            if tokens and rid not in first:
                first[rid] = now
        tick = time.perf_counter()
        engine_outputs = scheduler.update_from_output(out, result)
        host_s += time.perf_counter() - tick
        counters.add(engine_outputs)
        for batch in engine_outputs.values():
            for o in batch.outputs:
                if o.finished:
                    done[o.request_id] = now
                    bar.update()
        if args.system == "plugin" and scheduler.offload.level != levels[-1]:
            levels.append(scheduler.offload.level)
    bar.close()
    summary = report(arrival, first, done, outputs, now, steps, levels)
    # The scheduler's own host time a step (this machine's CPU; not simulated, not replayed):
    # what the plugin's scheduler adds to vLLM's, which async scheduling hides behind the GPU.
    summary["host_ms_per_step"] = round(host_s / max(steps, 1) * 1e3, 3)
    summary["preemptions"] = sum(r.num_preemptions for r in made)
    summary["peak_kv_usage"] = round(peak_kv, 4)
    summary["kv_blocks_level_0"] = (
        scheduler.offload.plan.capacity_blocks(0) if args.system == "plugin" else args.kv_blocks
    )
    summary.update(counters.as_dict())
    if tier is not None:
        summary["cpu_tier"] = {
            "blocks_loaded": tier.loaded_blocks,
            "blocks_stored": tier.stored_blocks,
            "idle_steps": idle_steps,
            "launches_from_load_to_schedule": dict(sorted(after_load.items())),
        }
    return summary


class PrefixCounters:
    """vLLM's own prefix-cache counters, in tokens, summed over the steps' scheduler stats as
    its Prometheus logger sums them: the GPU's cache (``vllm:prefix_cache_*``) and, with a
    KV connector, the CPU tier's (``vllm:external_prefix_cache_*``)."""

    def __init__(self) -> None:
        self.counts = {"gpu": [0, 0], "cpu": [0, 0]}  # [queries, hits]

    def add(self, engine_outputs: Any) -> None:
        for outputs in engine_outputs.values():
            stats = outputs.scheduler_stats
            if stats is None:
                continue
            for tier, cache in (
                ("gpu", stats.prefix_cache_stats),
                ("cpu", stats.connector_prefix_cache_stats),
            ):
                if cache is not None:
                    self.counts[tier][0] += cache.queries
                    self.counts[tier][1] += cache.hits

    def as_dict(self) -> dict[str, float | None]:
        return {
            f"hit_rate_{tier}": round(hits / queries, 4) if queries else None
            for tier, (queries, hits) in self.counts.items()
        }


def report(
    arrival: dict[str, float],
    first: dict[str, float],
    done: dict[str, float],
    outputs: dict[str, int],
    end: float,
    steps: int,
    levels: list[int],
) -> dict[str, Any]:
    e2e = sorted((done[r] - arrival[r]) * 1e3 for r in done)
    ttft = sorted((first[r] - arrival[r]) * 1e3 for r in first)
    tpot = [
        (done[r] - first[r]) * 1e3 / (outputs[r] - 1) for r in done if outputs[r] > 1 and r in first
    ]

    def p99(values: list[float]) -> float:
        return values[min(len(values) - 1, int(0.99 * len(values)))] if values else 0.0

    span = end - min(arrival.values()) if arrival else 0.0
    return {
        "completed": len(done),
        "failed": len(arrival) - len(done),
        "duration_s": round(span, 3),
        "request_throughput": round(len(done) / span, 4) if span else 0.0,
        "mean_e2el_ms": round(statistics.fmean(e2e), 2) if e2e else 0.0,
        "median_e2el_ms": round(statistics.median(e2e), 2) if e2e else 0.0,
        "p99_e2el_ms": round(p99(e2e), 2),
        "median_ttft_ms": round(statistics.median(ttft), 2) if ttft else 0.0,
        "p99_ttft_ms": round(p99(ttft), 2),
        "median_tpot_ms": round(statistics.median(tpot), 3) if tpot else 0.0,
        "steps": steps,
        "levels_visited": levels,
    }


def read_trace(path: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        {
            "t": float(r.get("timestamp", r.get("t", 0.0))),
            "prompt_len": max(1, int(r.get("input_length", r.get("prompt_len", 1)))),
            "output_len": max(1, int(r.get("output_length", r.get("output_len", 1)))),
            "hash_ids": r.get("hash_ids"),
        }
        for r in rows
    ]


# Held-back H200 points (stock vLLM, defaults, Qwen3-32B at 0.62, vllm serve): the trace that
# made each, and its committed run. The step model was not fitted to any of them.
VALIDATION = {
    "bursty_short": (
        "bursty --workload sharegpt --lull-rate 3 --burst-rate 18 --lull-s 10 --burst-s 30 "
        "--cycles 1",
        "bench/results/no_harm/qwen3-32b_b_bursty_short/stock_h200.json.gz",
    ),
    "sharegpt_r16": (
        "poisson --rate 16 --seconds 45",
        "bench/results/no_harm/qwen3-32b_b_sharegpt/stock_r16_h200.json.gz",
    ),
    "sharegpt_r18": (
        "poisson --rate 18 --seconds 60",
        "bench/results/no_harm/qwen3-32b_b_sharegpt/stock_r18_h200.json.gz",
    ),
    "sharegpt_r20": (
        "poisson --rate 20 --seconds 60",
        "bench/results/no_harm/qwen3-32b_b_sharegpt/stock_r20_h200.json.gz",
    ),
}
COMPARED = (
    "request_throughput",
    "median_e2el_ms",
    "p99_e2el_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
)


def validate(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Predicted against measured on every held-back point, with each metric's error: the
    H200's runs of ``args.system`` (its server and ours, on the same trace; the plugin's on
    PCIe, where it held k = 0)."""
    import shlex
    import subprocess
    import sys

    from bench.common import read_results

    entries = []
    for name, (trace_args, run_path) in VALIDATION.items():
        trace = tmp / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "bench.traces", *shlex.split(trace_args), "--out", str(trace)]
        subprocess.run(cmd, check=True, capture_output=True)
        predicted = simulate(args, step_model_for(args, args.link_GBps), read_trace(str(trace)))
        run_path = run_path.replace("/stock_", f"/{args.system}_")
        measured = read_results(str(ROOT / run_path))["client"]
        errors = {k: round(predicted[k] / measured[k] - 1, 4) for k in COMPARED if measured.get(k)}
        entries.append(
            {
                "point": name,
                "system": args.system,
                "levels_visited": predicted["levels_visited"],
                "trace": trace_args,
                "measured_run": run_path,
                "predicted": {k: predicted[k] for k in COMPARED},
                "measured": {k: round(measured[k], 3) for k in COMPARED},
                "error": errors,
            }
        )
        print(f"[simulator] {name}: " + json.dumps(errors), flush=True)
    return {"validation": entries}


def sustainable(result: dict[str, Any], ttft_bound_ms: float) -> bool:
    """A rate is sustained when the server keeps up: every request completes and the P99
    time to first token stays under ``ttft_bound_ms`` (a queue that grows over the trace
    shows there first; the client's throughput counts the drain after the last arrival)."""
    return result["failed"] == 0 and result["p99_ttft_ms"] <= ttft_bound_ms


def predict(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Max sustainable rate of stock and of the plugin on each link (a staircase
    of ``--rates``, each a fresh ``--seconds`` Poisson trace), and their ratio."""
    import shlex
    import subprocess
    import sys

    rows: dict[str, Any] = {}
    traces = {}
    for rate in args.rates:
        path = tmp / f"r{rate}.jsonl"
        spec = f"poisson --workload {args.workload} --rate {rate} --seconds {args.seconds}"
        cmd = [sys.executable, "-m", "bench.traces", *shlex.split(spec), "--out", str(path)]
        subprocess.run(cmd, check=True, capture_output=True)
        traces[rate] = read_trace(str(path))

    def staircase(system: str, link: float) -> dict[str, Any]:
        run_args = argparse.Namespace(**{**vars(args), "system": system, "link_GBps": link})
        best, points = 0.0, []
        for rate in args.rates:
            result = simulate(run_args, step_model_for(args, link), traces[rate])
            ok = sustainable(result, args.ttft_bound_ms)
            points.append({"rate": rate, "sustained": ok, **result})
            print(f"[simulator] {system} {link} GB/s {rate} req/s: {ok}", flush=True)
            if not ok:
                break
            best = rate
        return {"max_sustainable_rps": best, "points": points}

    stock = staircase("stock", args.link_GBps)
    rows["stock"] = stock
    for link in args.links:
        plugin = staircase("plugin", link)
        plugin["dynamic_over_stock"] = (
            round(plugin["max_sustainable_rps"] / stock["max_sustainable_rps"], 4)
            if stock["max_sustainable_rps"]
            else None
        )
        rows[f"plugin_{link:g}GBps"] = plugin
    name = args.served_model if args.machine is None else f"{args.served_model}_{args.machine}"
    if args.tp > 1:
        name += f"_tp{args.tp}"
    rows["kv_blocks_level_0"] = args.kv_blocks
    rows["step_model"] = dataclasses.asdict(step_model_for(args, args.link_GBps))
    return {"predictions": {f"{name}_{args.workload}": rows}}


DECODE_BATCHES = (16, 64, 256)  # --check-steps: the decode-only steps' batch classes


def step_class(shape: Any) -> str:
    """``decode <=16`` ... ``decode >256`` for decode-only steps, ``mixed`` with prefill."""
    if not shape.decode_only:
        return "mixed"
    bound = next((b for b in DECODE_BATCHES if shape.num_decode_tokens <= b), None)
    return f"decode <={bound}" if bound else f"decode >{DECODE_BATCHES[-1]}"


LONG_PREFILL = 2048  # --check-steps: a prefill chunk's mean attended context that is long


def _timed_rows(forward_steps: dict[str, Any]) -> list[tuple[int, Any, int, float]]:
    """``(level, StepShape, prefill_pairs, forward_ms)`` of each timed, non-empty step (runs
    before the pairs were recorded: 0 pairs)."""
    from dynoff.policy.latency import StepShape

    col = {name: i for i, name in enumerate(forward_steps["columns"])}
    pairs_col = col.get("prefill_pairs")
    rows = []
    for row in forward_steps["rows"]:
        decode, prefill = int(row[col["decode_tokens"]]), int(row[col["prefill_tokens"]])
        measured = float(row[col["forward_ms"]])
        if measured <= 0 or decode + prefill == 0:
            continue
        pairs = int(row[pairs_col]) if pairs_col is not None and pairs_col < len(row) else 0
        shape = StepShape(decode, prefill, int(row[col["context"]]))
        rows.append((int(row[col["level"]]), shape, pairs, measured))
    return rows


def timed_steps_of(path: str) -> dict[str, Any] | None:
    """The timed steps of a plugin serving run (``bench.serve_bench``'s ``forward_steps``)
    or of a plugin trace (JSON lines, gzip or not: a microbenchmark's), or None."""
    import gzip

    from bench.common import read_results
    from bench.serve_bench import forward_steps

    if path.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            return forward_steps([json.loads(line) for line in f if line.strip()])
    steps = (read_results(path).get("plugin") or {}).get("forward_steps")
    return steps if isinstance(steps, dict) else None


def check_steps(model: StepModel, forward_steps: dict[str, Any]) -> dict[str, Any]:
    """The step model against the steps a serving run timed (``bench.serve_bench``'s
    ``forward_steps``): per class of step, how many, and the median, 10th and 90th
    percentile of predicted / measured - 1. End-to-end figures blend every step's error
    with the scheduler's; this reads the model alone, where the GPU measured it. Mixed
    steps whose prefill chunks attend more than ``LONG_PREFILL`` tokens on average (runs
    that recorded the pairs) are also classed apart: their attention is what a per-token
    prefill price misses."""
    cost = model.cost_model()
    errors: dict[str, list[float]] = {}
    for level, shape, pairs, measured in _timed_rows(forward_steps):
        predicted = model.step_ms(cost, level, shape, pairs)
        error = predicted / measured - 1
        errors.setdefault(step_class(shape), []).append(error)
        if shape.num_prefill_tokens and pairs > LONG_PREFILL * shape.num_prefill_tokens:
            errors.setdefault(f"mixed, context >{LONG_PREFILL}", []).append(error)
    errors["all"] = [e for name, values in errors.items() if "," not in name for e in values]
    return {name: _spread(values) for name, values in errors.items() if values}


FIT_SHARES = tuple(k / 40 for k in range(40, -1, -1))  # --fit-prefill: 1.0 (the sum) first


def fit_prefill(model: StepModel, *runs: dict[str, Any]) -> StepModel:
    """``model`` with its prefill prices fitted to the level-0 mixed steps of one run or
    several (their ``forward_steps``): ``ms_per_prefill_token``, ``ms_per_prefill_pair`` and
    the roofline's ``fixed_share``, least squares in relative error (as
    :class:`~dynoff.policy.latency.StepTimeFit`), neither price negative. The share is
    searched on a grid (:data:`FIT_SHARES`; on a tie the sum, 1.0, stays), the prices solved
    for each share; a step's branch of the roofline depends on the token price, so each
    solve alternates the two until the branches stand still."""
    cost = model.cost_model()
    rows = []
    for run in runs:
        for level, shape, pairs, measured in _timed_rows(run):
            if not level and not shape.decode_only:
                base = cost.step_ms(0, shape._replace(num_prefill_tokens=0))
                rows.append((shape, pairs, measured, base))
    if not rows:
        raise ValueError("no level-0 step with a prefill to fit the prefill price to")
    best: tuple[float, StepModel] | None = None
    for share in FIT_SHARES:
        fitted = _fit_prices(dataclasses.replace(model, fixed_share=share), rows)
        fitted_cost = fitted.cost_model()
        rss = sum(
            (fitted.step_ms(fitted_cost, 0, shape, pairs) / measured - 1) ** 2
            for shape, pairs, measured, _ in rows
        )
        if best is None or rss < best[0] - 1e-12:
            best = (rss, fitted)
    assert best is not None
    return best[1]


def _fit_prices(model: StepModel, rows: list[tuple[Any, int, float, float]]) -> StepModel:
    """The two prices at ``model``'s share: each row's time beyond its decode part (``base``)
    is, on the compute-bound branch, the token price times the tokens it charges plus the
    pair price times its pairs; on the memory-bound branch its pairs alone."""
    price, seen = model.ms_per_prefill_token, None
    for _ in range(50):
        sums = [0.0] * 5  # tt, tp, pp, ty, py
        branches = []
        for (decode, prefill, _), pairs, measured, base in rows:
            bound = model.compute_bound(decode, prefill, price)
            if bound is None:  # memory-bound: the pairs alone are priced here
                x, y = 0.0, measured - base - model.ms_per_decode_token * prefill
            else:
                x, y = float(bound[0]), measured - base + bound[1]
            branches.append(bound)
            w = 1.0 / measured**2
            sums[0] += w * x * x
            sums[1] += w * x * pairs
            sums[2] += w * pairs * pairs
            sums[3] += w * x * y
            sums[4] += w * pairs * y
        per_token, per_pair = _solve_prices(*sums)
        if branches == seen or per_token <= 0:
            break
        price, seen = per_token, branches
    return dataclasses.replace(model, ms_per_prefill_token=per_token, ms_per_prefill_pair=per_pair)


def _solve_prices(tt: float, tp: float, pp: float, ty: float, py: float) -> tuple[float, float]:
    """Weighted least squares of ``y ~ token price · x + pair price · pairs`` from its normal
    equations' sums, neither price negative (one alone when the pair cannot be told apart)."""
    det = tt * pp - tp * tp
    per_token = per_pair = 0.0
    if tt > 0 and pp > 0 and det > 1e-12 * tt * pp:
        per_token, per_pair = (ty * pp - py * tp) / det, (py * tt - ty * tp) / det
    if per_pair <= 0 or per_token <= 0:  # one price alone
        alone = ([(max(ty / tt, 0.0), 0.0)] if tt > 0 else []) + (
            [(0.0, max(py / pp, 0.0))] if pp > 0 else []
        )

        def rss(prices: tuple[float, float]) -> float:
            t, q = prices
            return t * t * tt + 2 * t * q * tp + q * q * pp - 2 * (t * ty + q * py)

        per_token, per_pair = min(alone, key=rss, default=(0.0, 0.0))
    return per_token, per_pair


def _spread(values: list[float]) -> dict[str, Any]:
    from bench.common import nearest_rank

    ordered = sorted(values)

    def at(q: float) -> float:
        return round(nearest_rank(ordered, q), 4)

    return {"steps": len(ordered), "median": at(0.5), "p10": at(0.1), "p90": at(0.9)}


def step_model_for(args: argparse.Namespace, link_GBps: float) -> StepModel:
    """The H200's calibrated Qwen3-32B, or with ``--machine`` the scaled model; with
    ``--calibration`` the decode steps, piecewise penalty and change stalls a plugin server
    measured on its machine replace theirs (:func:`from_calibration`); with
    ``--ms-per-prefill-token`` the prefill token's price is that."""
    if args.machine is None:
        model = StepModel(link_GBps=link_GBps)
    else:
        served = MODELS[args.served_model]
        model = scaled_step_model(MACHINES[args.machine], served, args.tp, link_GBps)
    if getattr(args, "calibration", None):
        from bench.common import read_results

        run = read_results(args.calibration)
        calibration = (run.get("plugin") or {}).get("calibration") or run.get("calibration")
        if not calibration:
            raise ValueError(f"{args.calibration}: no calibration (a plugin run of serve_bench)")
        model = from_calibration(calibration, model)
    if getattr(args, "ms_per_prefill_token", None) is not None:
        model = dataclasses.replace(model, ms_per_prefill_token=args.ms_per_prefill_token)
    if getattr(args, "ms_per_prefill_pair", None) is not None:
        model = dataclasses.replace(model, ms_per_prefill_pair=args.ms_per_prefill_pair)
    if getattr(args, "fixed_share", None) is not None:
        model = dataclasses.replace(model, fixed_share=args.fixed_share)
    return model


def from_calibration(calibration: dict[str, Any], base: StepModel) -> StepModel:
    """``base`` with what a plugin server measured at start-up, before serving (its trace's
    ``calibration`` event): the decode step's fixed part and per-token cost fitted to its
    FULL-graph decode steps by the policy's own :class:`StepTimeFit` (as
    :func:`~dynoff.policy.pricing.model_error` fits them), its piecewise penalty and its
    level changes' stalls. Prefill, attention's context term and the link stay ``base``'s: the
    calibration's decode steps carry no prefill and little context. On the H100 (2026-12-06)
    the scaled model made those steps 7-18% slower than the card measured them. And what its
    level-1 steps measured beyond the model (:attr:`StepModel.level_excess`)."""
    from dynoff.policy.latency import OffloadCostModel, StepShape, StepTimeFit
    from dynoff.policy.messages import Calibration
    from dynoff.policy.pricing import model_error

    rows = calibration.get("decode_steps") or []
    if len(rows) < 2:
        raise ValueError("the calibration has fewer than two decode steps (no CUDA graphs?)")
    fit = StepTimeFit()
    for batch, full, *_ in rows:
        fit.observe(StepShape(int(batch)), float(full))
    cost = fit.solve()
    if cost is None:
        raise ValueError(f"the calibration's decode steps fit no step time: {rows}")
    penalty = float(calibration["piecewise_penalty_ms"])
    measured = Calibration(
        h2d_GBps=float(calibration.get("h2d_GBps") or base.link_GBps),
        layer_copy_ms=float(calibration.get("layer_copy_ms") or 0.0),
        piecewise_penalty_ms=penalty,
        decode_steps=tuple((int(r[0]), *map(float, r[1:])) for r in rows if len(r) >= 4),
    )

    def build(step: Any) -> OffloadCostModel:  # as the policy builds it (controller.py)
        return OffloadCostModel.from_step_cost(
            base.num_layers,
            base.layer_bytes,
            measured.h2d_GBps * 1e9,
            step,
            piecewise_penalty_ms=penalty,
        )

    return dataclasses.replace(
        base,
        intercept_ms=cost.intercept_ms,
        ms_per_decode_token=cost.ms_per_decode_token,
        piecewise_penalty_ms=penalty,
        stall_up_ms=float(calibration["stall_up_ms"]),
        stall_down_ms=float(calibration["stall_down_ms"]),
        level_excess=model_error(measured, build),
    )


def resolve(args: argparse.Namespace) -> None:
    """Fill what ``--machine`` / ``--served-model`` / ``--tp`` imply: the model's config, the
    KV blocks stock gets at ``--utilization``, and the machine's link."""
    served = MODELS[args.served_model]
    if args.model is None:
        args.model = str(ROOT / served.config_dir)
    if getattr(args, "max_level", None) is None:  # the plugin's, where the host holds the homes
        args.max_level = served.num_layers // 2
    if args.machine is None:
        if args.kv_blocks is None:
            args.kv_blocks = 6095  # stock's KV at 0.62 on the H200 (Qwen3-32B)
        return
    machine = MACHINES[args.machine]
    if args.kv_blocks is None:
        args.kv_blocks = stock_kv_blocks(machine, served, args.tp, args.utilization)
    if args.link_GBps is None:
        args.link_GBps = machine.link_GBps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=["stock", "plugin"], default=None)
    parser.add_argument(
        "--check-steps",
        nargs="+",
        default=None,
        metavar="RUN",
        help="bench.serve_bench results of the plugin: the step model against their timed "
        "steps (--machine and --link-GBps as the run's)",
    )
    parser.add_argument("--trace", default=None, help="bench.traces JSON lines (or --validate)")
    parser.add_argument("--validate", action="store_true", help="the held-back H200 points")
    parser.add_argument("--predict", action="store_true", help="max sustainable rates")
    parser.add_argument("--rates", type=float, nargs="+", default=[12, 14, 16, 18, 20, 22])
    parser.add_argument("--links", type=float, nargs="+", default=[55.3, 392.0, 900.0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--workload", default="sharegpt", help="--predict: bench/workloads/")
    parser.add_argument("--ttft-bound-ms", type=float, default=1000.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="config dir (default: the served model's)")
    parser.add_argument("--served-model", choices=sorted(MODELS), default="qwen3-32b")
    parser.add_argument(
        "--machine", choices=sorted(MACHINES), default=None, help="a scaled step model"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="RUN",
        help="a plugin serve_bench result: its server's start-up calibration (decode steps, "
        "piecewise penalty, change stalls) replaces the step model's",
    )
    parser.add_argument("--utilization", type=float, default=0.9, help="with --machine")
    parser.add_argument("--kv-blocks", type=int, default=None, help="default: 6,095 (H200, 0.62)")
    parser.add_argument(
        "--max-level",
        type=int,
        default=None,
        help="default: the plugin's, half the decoder layers (where the host memory holds "
        "their homes, as on the H100 and H200 machines)",
    )
    parser.add_argument("--link-GBps", type=float, default=None, help="default: the machine's")
    # vllm serve's defaults on a GPU of 70 GiB or more (H100, H200, GH200, GB200): vLLM's
    # EngineArgs sets 1,024 sequences and 8,192 batched tokens for the API server there.
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--plugin-config", default="{}")
    parser.add_argument(
        "--admission",
        choices=["async", "sync"],
        default="async",
        help="async (vLLM's default scheduling, stock's and the plugin's): the engine keeps "
        "two steps in flight, so a request arriving while a step runs joins the step after "
        "next and a step's results (finished requests' blocks among them) reach the "
        "scheduler a step late; sync: one step at a time",
    )
    parser.add_argument(
        "--kv-reads",
        choices=["per-request", "per-block"],
        default="per-request",
        help="what a decode step's attention reads from HBM: every request's context apiece "
        "(per-request), or each KV block once, however many requests share it through the "
        "prefix cache (per-block: the H100's doc-QA decode steps flatten past ~16 requests, "
        "but priced so the simulated steps come 2-9%% fast, RESULTS.md)",
    )
    parser.add_argument(
        "--ms-per-prefill-token",
        type=float,
        default=None,
        help="the step model's price of a prefill token on the compute-bound side of its "
        "roofline (default 0.1008: the H200 microbenchmark's prefill of 2,048-token prompts "
        "less their attended pairs; a decode token costs 0.057): how much the validation "
        "rests on it",
    )
    parser.add_argument(
        "--ms-per-prefill-pair",
        type=float,
        default=None,
        help="the step model's price of a (query, key) pair a prefill chunk attends "
        "(default 3.49e-6: fitted on an H100, scaled to the H200; --check-steps RUN "
        "--fit-prefill fits it to a run)",
    )
    parser.add_argument(
        "--fixed-share",
        type=float,
        default=None,
        help="the share of a step's fixed part outside its roofline (default 0.225, fitted on "
        "an H100; 1.0: a prefill priced on top of the decode step)",
    )
    parser.add_argument(
        "--fit-prefill",
        action="store_true",
        help="with --check-steps: fit the prefill prices to the run's level-0 steps and "
        "check the model with them too",
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB: vLLM's CPU KV offloading (its OffloadingConnector), for either system",
    )
    for direction, measured in (
        ("load", "35-42 under stock, 54 under the plugin"),
        ("store", "48-51 under stock, 54 under the plugin"),
    ):
        parser.add_argument(
            f"--tier-{direction}-GBps",
            type=float,
            default=None,
            help=f"the CPU tier's {direction}s' bandwidth (default: the link's; on an H100's "
            f"55 GB/s link vLLM's metrics measured {measured})",
        )
    args = parser.parse_args()
    from bench.common import write_results

    if args.machine is None and args.link_GBps is None:
        args.link_GBps = 55.3
    resolve(args)
    try:
        model = step_model_for(args, args.link_GBps)
    except ValueError as exc:
        parser.error(str(exc))
    if args.check_steps:

        def prices(fitted: StepModel) -> dict[str, float]:
            return {
                "ms_per_prefill_token": round(fitted.ms_per_prefill_token, 5),
                "ms_per_prefill_pair": fitted.ms_per_prefill_pair,
                "fixed_share": fitted.fixed_share,
            }

        checks: dict[str, Any] = {}
        runs = {}
        for path in args.check_steps:
            steps = timed_steps_of(path)
            if not steps:
                parser.error(f"{path}: no timed steps (a plugin run of serve_bench, or a trace)")
            runs[path] = steps
            if args.fit_prefill:
                fitted = fit_prefill(model, steps)
                checks[path] = {
                    "check": check_steps(model, steps),
                    "fitted": prices(fitted),
                    "check_fitted": check_steps(fitted, steps),
                }
            else:
                checks[path] = check_steps(model, steps)
            for name, row in checks[path].items():
                print(f"{path} {name}: {row}")
        if args.fit_prefill and len(runs) > 1:  # one fit over every run's steps
            fitted = fit_prefill(model, *runs.values())
            checks["combined"] = {
                "fitted": prices(fitted),
                **{path: check_steps(fitted, steps) for path, steps in runs.items()},
            }
            print(f"combined fitted: {checks['combined']['fitted']}")
        write_results(args.out, {"check_steps": checks, "model": dataclasses.asdict(model)})
        return
    if args.system is None:
        parser.error("--system is required")
    if args.validate:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result = validate(args, Path(tmp))
        version = f"the H200's held-back runs of {args.system} on PCIe (55.3 GB/s)"
        result.update(version=version, model=dataclasses.asdict(model))
        write_results(args.out, result)
        return
    if args.predict:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result = predict(args, Path(tmp))
        version = (
            "the H200-calibrated Qwen3-32B at a GH200-sized KV cache (stock's blocks at "
            "0.62); links are emulated by the step model"
            if args.machine is None
            else f"a SCALED step model (scaled_step_model): {args.served_model} on "
            f"{args.machine}, TP {args.tp}, stock's KV at {args.utilization}: "
            f"{args.kv_blocks} blocks a GPU"
            + (
                "; mixture of experts: the KV tiers planned for the MoE layer's bytes on a "
                "dense stand-in of its config (the plugin refuses MoE models in serving)"
                if MODELS[args.served_model].moe
                else ""
            )
        )
        result.update(
            version=version,
            ttft_bound_ms=args.ttft_bound_ms,
            model=dataclasses.asdict(model),
        )
        write_results(args.out, result)
        return
    if args.trace is None:
        parser.error("give --trace, --validate or --predict")
    result = simulate(args, model, read_trace(args.trace))
    result.update(system=args.system, link_GBps=args.link_GBps, model=dataclasses.asdict(model))
    if args.kv_offloading_size:
        result.update(tier_load_GBps=args.tier_load_GBps, tier_store_GBps=args.tier_store_GBps)

    write_results(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "model"}))


if __name__ == "__main__":
    main()
