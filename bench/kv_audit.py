"""A memory audit of the level changes on the CPU: does any live request's KV, or any layer's
weights, change under a level change? vLLM's real scheduler with the plugin's policy and
elastic pool (``DynamicOffloadScheduler``, as in :mod:`bench.simulator`) drives the
plugin's real worker-side memory as a worker applies its commands: a VMM arena on the host
backend (real page remaps: an unmapped page faults), the KV cache over it, the packed
weights and their pinned copies, the prefetch engine, the runtime's ops and the level
changer. Only the model's arithmetic is left out.

    python -m bench.kv_audit --out bench/results/kv_audit_qwen3-8b_scaled.json

Every token the scheduler schedules has its KV slot written with a pattern naming its
request and position, in the block the step's block table gives it (the prompts share no
prefix, so a block's pattern names the one request that wrote it; a preempted request that
resumes finds its own cached blocks); every layer the forward would run reads its weights
through its own addresses (its pages, or the shared region the prefetch filled) and must
find its own bytes. After every level change, and every
``--check-every`` steps, each live request's KV (every token written so far) must still
hold its patterns, and no block of it may lie on an unmapped group. The engine core's
order is kept: with ``--batch-queue 2`` (vLLM's async scheduling) step N+1 is scheduled
and executed before step N's output is processed, and a command rides with the step it
was scheduled with.

The default geometry is the H100's Qwen3-8B packed-layout run scaled down 256x
(``bench/results/e2e_distinct/``: 36 layers, 16-token blocks of 2.25 MiB over all layers,
16 MiB pages, 368 MiB layers, 22,848 blocks at level 0, max level 18): blocks of 9 KiB,
64 KiB pages, layers of 23 pages, so groups of 64 blocks over 9 pages and a level of 23
pages, as there; its 256 requests (``bench.gpu.e2e_correctness.workload``) and its forced
schedule 0 -> 18 -> 0.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).parents[1]
BLOCK_SIZE = 16


@dataclasses.dataclass
class Geometry:
    num_layers: int = 36
    layer_bytes: int = 23 * (64 << 10)  # 368 MiB / 256: 23 pages of 64 KiB
    block_bytes: int = 9 << 10  # 2.25 MiB / 256: one block over every layer (packed)
    page_size: int = 64 << 10
    kv_blocks: int = 22_848  # level 0's capacity, as on the H100
    max_level: int = 18


class Layer(nn.Module):
    """A decoder layer's matrices, ``layer_bytes`` of bf16, distinct per layer."""

    def __init__(self, index: int, nbytes: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1000 + index)
        values = torch.randn(nbytes // 2, generator=generator).to(torch.bfloat16)
        self.weight = nn.Parameter(values.view(-1, 64), requires_grad=False)


def build_scheduler(geometry: Geometry, config: dict[str, Any], args: argparse.Namespace) -> Any:
    """vLLM's scheduler with the plugin, over a KV cache of one buffer whose blocks are
    ``block_bytes`` apart (the packed layout's geometry)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from dynoff.policy.geometry import per_layer_kv_cache_config, plan_capacity
    from dynoff.policy.scheduler import DynamicOffloadScheduler

    model_config = ModelConfig(
        model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
    )
    # One "layer" whose block holds every layer's K and V: bytes 2 x 16 x heads x dim x 2.
    head_size = geometry.block_bytes // (2 * BLOCK_SIZE * 2)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16
    )
    assert spec.page_size_bytes == geometry.block_bytes
    plan = plan_capacity(
        (geometry.block_bytes,),
        geometry.kv_blocks,
        geometry.layer_bytes,
        geometry.max_level,
        geometry.page_size,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache,
        scheduler_config=sched,
        parallel_config=ParallelConfig(),
        additional_config={"dynamic_offload": config},
    )
    cache.num_gpu_blocks = plan.num_blocks
    kv = per_layer_kv_cache_config(plan.num_blocks, spec, 1)
    scheduler = DynamicOffloadScheduler(
        vllm_config, kv, StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE
    )
    return scheduler, kv


class Worker:
    """The plugin's worker-side memory for the audit: weights, KV cache, engine, changer."""

    def __init__(self, geometry: Geometry, kv_cache_config: Any) -> None:
        from dynoff.allocator import VmmArena
        from dynoff.allocator.kv_cache import VmmKVCache
        from dynoff.compile_pass.levels import LevelChanger
        from dynoff.compile_pass.placement import WeightPlacement
        from dynoff.compile_pass.prefetch import PrefetchEngine
        from dynoff.compile_pass.runtime import OffloadRuntime
        from dynoff.policy.geometry import plan_report, recover_plan

        self.geometry = geometry
        self.arena = VmmArena("host", page_size=geometry.page_size)
        layers = [Layer(i, geometry.layer_bytes) for i in range(geometry.num_layers)]
        self.expected = [layer.weight.detach().clone().view(torch.int64) for layer in layers]
        self.placement = WeightPlacement(self.arena, layers, geometry.max_level)
        self.words = [layer.weight.detach().view(torch.int64) for layer in layers]
        self.offloadable = frozenset(self.placement.offloadable())
        if self.placement.pages_per_layer * geometry.page_size != geometry.layer_bytes:
            raise ValueError("a layer must fill whole pages in this audit")
        self.engine = PrefetchEngine.for_placement(self.placement)
        self.runtime = OffloadRuntime(geometry.num_layers, self.engine)
        # The plan as a worker recovers it from the KV cache config; the scheduler checks
        # this rank's report of it against its own on the first step.
        plan, layout = recover_plan(
            kv_cache_config, geometry.layer_bytes, geometry.max_level, geometry.page_size
        )
        self.plan_report = plan_report(0, plan, layout, "per_layer", self.placement.pages_per_layer)
        self.kv = VmmKVCache(self.arena, kv_cache_config, plan.group_blocks, plan.groups_at(0))
        self.changer = LevelChanger(0, self.placement, self.kv, self.engine, self.runtime)
        (tensor,) = {id(t): t for t in self.kv.tensors().values()}.values()
        words = geometry.block_bytes // 8 // BLOCK_SIZE
        self.slots = tensor.view(torch.int64)[: plan.num_blocks * BLOCK_SIZE * words].view(
            plan.num_blocks, BLOCK_SIZE, words
        )

    def inject(self, fault: str, live_block: Callable[[], int]) -> None:
        """Make the audit see a fault the real code cannot produce on demand (its negative
        controls): ``unmap-live``, each lowering also unmaps the group of a block a live
        request holds (``live_block``); ``stray-copy``, each restore copy also lands on the
        KV page of such a block; ``wrong-partner``, offloaded layers are copied in with
        their partner's weights (:func:`bench.weights.wrong_partner`)."""
        if fault == "wrong-partner":
            from bench.weights import wrong_partner

            wrong_partner(type("W", (), {"_dynoff": self})())
            return
        kv, engine, page = self.kv, self.engine, self.geometry.page_size
        if fault == "unmap-live":
            unmap = kv.unmap_groups

            def unmap_more(groups: Any, synchronize: bool = True) -> None:
                victim = live_block() // kv.group_blocks
                extra = [victim] if victim in kv.backed and victim not in groups else []
                unmap([*groups, *extra], synchronize)

            kv.unmap_groups = unmap_more
        elif fault == "stray-copy":
            restore = engine.restore

            def restore_astray(layer: int) -> None:
                restore(layer)
                kv_bytes = self.slots.view(-1).view(torch.uint8)
                start = live_block() * self.geometry.block_bytes // page * page
                kv_bytes[start : start + page].copy_(engine.sources[layer][:page])

            engine.restore = restore_astray
        elif fault != "none":
            raise ValueError(f"unknown fault {fault!r}")

    def intact(self, layer: int) -> bool:
        """Layer ``layer``'s weights, read through its own addresses, are its own bytes."""
        return torch.equal(self.words[layer], self.expected[layer])

    def forward(self, every_layer: bool = False) -> list[str]:
        """The ops of one forward, in the pass's order, and the weights each layer would
        read: the offloadable layers' at every step (their pages move), every layer's when
        ``every_layer`` (after a change); returns what was wrong."""
        from dynoff.compile_pass.pairing import partner

        wrong = []
        rt, n = self.runtime, self.geometry.num_layers
        for layer in range(n):
            if layer in rt.active or layer in self.engine.restoring:
                self.engine.wait(layer)
            if (every_layer or layer in self.offloadable) and not self.intact(layer):
                wrong.append(f"layer {layer} ran on bytes not its own at level {rt.level}")
            other = partner(layer, n)
            if other is not None and other in rt.active:
                self.engine.prefetch(other)
        return wrong


def pattern(request: int, positions: torch.Tensor) -> torch.Tensor:
    return (request + 1) * (1 << 24) + positions


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    from bench.gpu.e2e_correctness import forced_schedule, workload
    from dynoff.policy.messages import RUNNER_OUTPUT_ATTR, SCHEDULER_OUTPUT_ATTR, StepReport

    geometry = Geometry(
        num_layers=args.layers,
        kv_blocks=args.kv_blocks,
        max_level=args.max_level,
    )
    schedule = json.loads(args.schedule) if args.schedule else forced_schedule(args.max_level)
    config = {
        "host_page_size": geometry.page_size,
        "layer_bytes": geometry.layer_bytes,
        "policy": {"max_level": geometry.max_level},
        "level_schedule": schedule,
    }
    init_none_hash(sha256)
    scheduler, kv_config = build_scheduler(geometry, config, args)
    plan = scheduler.offload.plan
    worker = Worker(geometry, kv_config)
    requests = workload(args.requests, seed=args.seed)
    index: dict[str, int] = {}
    written: dict[str, int] = {}  # tokens whose KV slots hold their pattern
    for i, (prompt, output_len) in enumerate(requests):
        request = Request(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        index[request.request_id] = i
        written[request.request_id] = 0
        scheduler.add_request(request)

    violations: list[str] = []
    counts: collections.Counter[str] = collections.Counter()
    levels = [0]

    def note(what: str) -> None:
        counts["violations"] += 1
        if len(violations) < 50:
            violations.append(what)

    def block_ids(req_id: str) -> list[int]:
        return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def check(when: str) -> None:
        """Every live request's written KV still holds its patterns, on mapped groups."""
        counts["checks"] += 1
        for req_id, request in scheduler.requests.items():
            n = written.get(req_id, 0)
            if n == 0 or request.status != RequestStatus.RUNNING:
                continue  # a preempted request's KV is gone; it recomputes what it needs
            blocks = block_ids(req_id)[: -(-n // BLOCK_SIZE)]
            if len(blocks) * BLOCK_SIZE < n:
                note(f"{when}: {req_id} holds {len(blocks)} blocks for {n} tokens of KV")
                continue
            lost = [b for b in blocks if not worker.kv.maps_block(b)]
            if lost:
                note(f"{when}: {req_id} has blocks {lost[:4]} on unmapped groups")
                continue
            positions = torch.arange(n)
            where = torch.tensor(blocks)[positions // BLOCK_SIZE]
            got = worker.slots[where, positions % BLOCK_SIZE]
            want = pattern(index[req_id], positions)[:, None]
            bad = (got != want).any(dim=1).nonzero().flatten()
            counts["tokens_checked"] += n
            if len(bad):
                first = int(bad[0])
                note(
                    f"{when}: {req_id} lost the KV of {len(bad)} of {n} tokens (first: "
                    f"position {first}, block {int(where[first])})"
                )

    def execute(out: Any) -> Any:
        """What a worker does with one step: the command, the forward's ops, the KV."""
        command = getattr(out, SCHEDULER_OUTPUT_ATTR, None)
        outcomes: tuple[Any, ...] = ()
        if command is not None:
            outcome = worker.changer.apply(command)
            outcomes = (outcome,)
            counts["level_changes"] += int(outcome.ok)
            if not outcome.ok:
                note(f"step {command.step}: command {command.command_id} failed: {outcome.error}")
            worker.engine.synchronize()  # the restore copies land before the audit reads
            check(f"after the change to level {worker.placement.level} (step {command.step})")
            if worker.placement.level != levels[-1]:
                levels.append(worker.placement.level)
        for what in worker.forward(every_layer=command is not None):
            note(f"step {counts['steps'] + 1}: {what}")
        for req_id, num in out.num_scheduled_tokens.items():
            # The step's first position, as vLLM has it: num_computed_tokens already counts
            # this step's tokens (schedule() advances it). It must follow what the earlier
            # steps wrote, or start over (a preempted request recomputes its KV).
            start = scheduler.requests[req_id].num_computed_tokens - num
            if start != written[req_id]:
                counts["restarts" if start < written[req_id] else "gaps"] += 1
                if start > written[req_id]:
                    note(f"{req_id} scheduled from position {start}, {written[req_id]} written")
                written[req_id] = min(written[req_id], start)
            blocks = block_ids(req_id)
            positions = torch.arange(start, start + num)
            where = [blocks[p // BLOCK_SIZE] for p in range(start, start + num)]
            unmapped = sorted({b for b in where if not worker.kv.maps_block(b)})
            if unmapped:
                note(
                    f"step {counts['steps'] + 1}: {req_id} writes to unmapped blocks {unmapped[:4]}"
                )
                continue
            worker.slots[torch.tensor(where), positions % BLOCK_SIZE] = pattern(
                index[req_id], positions
            )[:, None]
            written[req_id] = start + num
            counts["tokens_written"] += num
        counts["steps"] += 1
        if counts["steps"] % args.check_every == 0:
            check(f"step {counts['steps']}")
        return outcomes

    def sampled(out: Any) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        tokens = [[7] if written[r] >= len(requests[index[r]][0]) else [] for r in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens,
        )

    def live_block() -> int:
        """A block of the live request that has written the most KV."""
        live = [r for r in written if r in scheduler.requests and written[r]]
        return block_ids(max(live, key=written.__getitem__))[0] if live else 0

    worker.inject(args.fault, live_block)
    started = time.perf_counter()
    in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
    last_command = -1
    while scheduler.has_requests() or in_flight:
        if scheduler.has_requests() and len(in_flight) < args.batch_queue:
            out = scheduler.schedule()
            in_flight.append((out, execute(out)))
            command = getattr(out, SCHEDULER_OUTPUT_ATTR, None)
            if command is not None:
                last_command = command.command_id
            if len(in_flight) < args.batch_queue and out.total_num_scheduled_tokens:
                continue
        out, outcomes = in_flight.popleft()
        result = sampled(out)
        report = StepReport(
            counts["updates"] + 1,
            worker.placement.level,
            0.0,
            outcomes=outcomes,
            plans=(worker.plan_report,) if counts["updates"] == 0 else (),
            last_command=last_command,
            level_now=worker.placement.level,
        )
        setattr(result, RUNNER_OUTPUT_ATTR, report)
        counts["updates"] += 1
        scheduler.update_from_output(out, result)
    check("at the end")
    return {
        "geometry": dataclasses.asdict(geometry),
        "group_blocks": plan.group_blocks,
        "capacity_blocks": {str(k): plan.capacity_blocks(k) for k in (0, geometry.max_level)},
        "requests": args.requests,
        "batch_queue": args.batch_queue,
        "fault": args.fault,
        "level_schedule": schedule,
        "levels_visited": levels,
        **{k: counts[k] for k in ("steps", "level_changes", "checks", "tokens_written")},
        "restarts": counts["restarts"],  # preempted requests recomputing their KV
        "tokens_checked": counts["tokens_checked"],
        "violations": counts["violations"],
        "first_violations": violations,
        "seconds": round(time.perf_counter() - started, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default=str(ROOT / "tests/models/qwen3-8b"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-blocks", type=int, default=22_848)
    parser.add_argument("--max-level", type=int, default=18)
    parser.add_argument("--schedule", default=None, help="level_schedule as JSON")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--batch-queue", type=int, default=2, choices=[1, 2])
    parser.add_argument("--check-every", type=int, default=16)
    parser.add_argument(
        "--fault",
        choices=["none", "unmap-live", "stray-copy", "wrong-partner"],
        default="none",
        help="a negative control: a fault the audit must see (Worker.inject)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "level_schedule"}, indent=1))
    if args.out:
        from bench.common import write_results

        write_results(args.out, result)


if __name__ == "__main__":
    main()
