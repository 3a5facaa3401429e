"""The ``--scheduler-cls`` subclass built on a real vLLM config (tiny Llama, CPU): it
recovers the worker's capacity plan, attaches one command per step to SchedulerOutput,
reads the worker's StepReport from ModelRunnerOutput, and the KV capacity the scheduler
sees follows the level."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from dynoff.policy.geometry import (
    PlanMismatchError,
    UnsupportedModelError,
    decoder_layer_bytes,
    layout_strides,
    per_layer_kv_cache_config,
    plan_capacity,
    planned_layer_bytes,
)
from dynoff.policy.latency import StepShape, prefill_pairs
from dynoff.policy.messages import PlanReport, ResizeOutcome, StepReport
from dynoff.policy.scheduler import DynamicOffloadScheduler
from dynoff.policy.status import STATUS_DIR_ENV, board_dir, publish_max_level
from tests.policy.kv_fixtures import SPEC, make_request

MODEL = str(Path(__file__).parents[1] / "models" / "tiny-llama")
PAGE = 64 << 10


def build(
    tmp_path: Path,
    schedule: list[list[int]],
    transfer: KVTransferConfig | None = None,
    published: int | None = None,
) -> DynamicOffloadScheduler:
    """The scheduler as vLLM builds it for a tiny Llama at levels 0..2 (``transfer``: a KV
    connector, e.g. vLLM's CPU KV offloading; ``published``: the max level rank 0's worker
    fitted to the host memory and published, the KV cache sized for it)."""
    model = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512)
    extra = {
        "dynamic_offload": {
            "host_page_size": PAGE,
            "level_schedule": schedule,
            "trace_path": str(tmp_path / "trace.jsonl"),
        }
    }
    cache = CacheConfig(block_size=16)
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
        additional_config=extra,
    )
    # What the worker does: size the KV cache for the highest level's capacity.
    strides = (SPEC.page_size_bytes,) * 4
    layer_bytes = decoder_layer_bytes(model.hf_config, 2)
    max_level = 2 if published is None else published
    plan = plan_capacity(
        strides, base_blocks=64, layer_bytes=layer_bytes, max_level=max_level, page_size=PAGE
    )
    if published is not None:
        publish_max_level(board_dir(vllm_config.instance_id), published)
    kv = per_layer_kv_cache_config(plan.num_blocks, SPEC, 4)
    assert layout_strides(kv) == strides
    cache.num_gpu_blocks = plan.num_blocks  # what EngineCore sets after profiling
    return DynamicOffloadScheduler(
        vllm_config, kv, StructuredOutputManager(vllm_config), block_size=16
    )


def finish_step(
    scheduler: DynamicOffloadScheduler,
    output,
    report: StepReport,
    connector: KVConnectorOutput | None = None,
) -> None:
    """The workers' answer to ``output``: one sampled token per request, the plugin's
    ``report`` and, with a KV connector, its worker half's ``connector`` output."""
    req_ids = list(output.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        kv_connector_output=connector,
    )
    result.dynamic_offload = report  # type: ignore[attr-defined]
    scheduler.update_from_output(output, result)


@pytest.mark.parametrize("ok", [True, False])
def test_commands_ride_on_scheduler_output_and_reports_come_back(tmp_path: Path, ok: bool) -> None:
    scheduler = build(tmp_path, schedule=[[1, 1]])
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 64  # level 0: the base capacity only
    scheduler.add_request(make_request(list(range(40))))
    first = scheduler.schedule()
    command = first.dynamic_offload  # type: ignore[attr-defined]
    assert command is not None and command.target_level == 1 and command.map_groups
    outcome = ResizeOutcome(command.command_id, 0, ok, "" if ok else "injected")
    finish_step(scheduler, first, StepReport(command.step, 1 if ok else 0, 5.0, 0, 40, (outcome,)))
    assert scheduler.offload.level == (1 if ok else 0)
    assert pool.num_gpu_blocks == (96 if ok else 64)
    second = scheduler.schedule()
    retry = second.dynamic_offload  # type: ignore[attr-defined]
    if ok:
        assert retry is None
    else:  # serving went on at level 0; the forced level is tried again
        assert retry.target_level == 1 and retry.command_id == command.command_id + 1
    assert second.num_scheduled_tokens  # the request kept running either way
    assert scheduler.offload.elastic.invariant_violations() == []
    scheduler.shutdown()
    assert (tmp_path / "trace.jsonl").read_text().count('"kind": "step"') == 2


def test_async_scheduling_stays_on(tmp_path: Path) -> None:
    """vLLM warns about any custom scheduler that async scheduling may be off. Ours keeps
    AsyncScheduler's bookkeeping: a scheduled decode holds an output placeholder until the
    step's output comes back, so the next step can be scheduled before it does."""
    scheduler = build(tmp_path, schedule=[])
    request = make_request(list(range(16)))
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert request.num_output_placeholders == 1
    finish_step(scheduler, first, StepReport(scheduler.current_step, 0, 5.0, 0, 16, ()))
    assert request.num_output_placeholders == 0
    scheduler.shutdown()


def worker_plan(scheduler: DynamicOffloadScheduler, rank: int = 0, **changes: int) -> PlanReport:
    """A worker's report of the plan it maps: the scheduler's own, changed by ``changes``."""
    expected = scheduler.offload.expected_plan
    assert expected is not None
    return dataclasses.replace(expected, rank=rank, **changes)


def test_the_scheduler_goes_on_only_if_every_rank_maps_its_plan(tmp_path: Path) -> None:
    """Item 1 of the hardening issue: the workers report the plan they map, and a scheduler
    that would hand out blocks no worker mapped stops, naming the difference."""
    scheduler = build(tmp_path, schedule=[])
    scheduler.add_request(make_request(list(range(16))))
    first = scheduler.schedule()
    plans = (worker_plan(scheduler, 0), worker_plan(scheduler, 1))
    finish_step(
        scheduler, first, StepReport(scheduler.current_step, 0, 5.0, 0, 16, (), None, 0.0, plans)
    )
    scheduler.shutdown()
    assert '"event": "plan_checked"' in (tmp_path / "trace.jsonl").read_text()

    scheduler = build(tmp_path, schedule=[])
    scheduler.add_request(make_request(list(range(16))))
    first = scheduler.schedule()
    expected = scheduler.offload.expected_plan
    assert expected is not None
    fewer = (
        worker_plan(scheduler, 0),
        worker_plan(scheduler, 1, base_groups=expected.base_groups - 1),
    )
    with pytest.raises(PlanMismatchError, match=r"rank 1 maps \{'base_groups'"):
        finish_step(
            scheduler,
            first,
            StepReport(scheduler.current_step, 0, 5.0, 0, 16, (), None, 0.0, fewer),
        )


def test_the_scheduler_serves_the_max_level_the_workers_could_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers fit the default max level to their host memory before they pin it; the
    scheduler, built after they pinned it, takes theirs from the board, not N/2 (2 for the
    tiny Llama's 4 layers), so the plans agree and level 2 is never handed out."""
    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    scheduler = build(tmp_path, schedule=[], published=1)
    assert scheduler.offload.plan.max_level == 1
    assert scheduler.offload.policy.max_level == 1
    expected = scheduler.offload.expected_plan
    assert expected is not None and expected.max_level == 1
    scheduler.add_request(make_request(list(range(16))))
    first = scheduler.schedule()
    plans = (worker_plan(scheduler, 0),)
    finish_step(
        scheduler, first, StepReport(scheduler.current_step, 0, 5.0, 0, 16, (), None, 0.0, plans)
    )
    scheduler.shutdown()
    assert '"event": "plan_checked"' in (tmp_path / "trace.jsonl").read_text()

    unpublished = build(tmp_path, schedule=[])  # no note on the board: the configuration's
    assert unpublished.offload.plan.max_level == 2
    # Workers that fitted a lower level than the scheduler knows (their note unread): the
    # first report stops the server, and the message gives the setting that agrees.
    fitted = worker_plan(unpublished, 0, max_level=1)
    with pytest.raises(PlanMismatchError, match=r'set "policy": \{"max_level": 1\}'):
        unpublished.offload.on_report(StepReport(0, 0, 0.0, plans=(fitted,)))
    unpublished.shutdown()
    with pytest.raises(PlanMismatchError, match=r"packed for max level 3 but .* at most 2"):
        build(tmp_path, schedule=[], published=3)


def test_a_plan_that_promises_more_pages_than_a_level_frees_is_refused(tmp_path: Path) -> None:
    scheduler = build(tmp_path, schedule=[])
    expected = scheduler.offload.expected_plan
    assert expected is not None
    short = worker_plan(scheduler, real_layer_pages=expected.layer_pages - 1)
    with pytest.raises(PlanMismatchError, match=r"frees .* pages but the plan promises"):
        scheduler.offload.on_report(StepReport(0, 0, 0.0, plans=(short,)))
    scheduler.shutdown()


def test_a_mixture_of_experts_model_is_refused_with_the_fix() -> None:
    mixtral = Path(__file__).parents[1] / "models" / "mixtral-8x22b"
    model = ModelConfig(model=str(mixtral), skip_tokenizer_init=True, dtype="bfloat16")
    with pytest.raises(UnsupportedModelError, match=r"num_local_experts=8.*serve this model"):
        decoder_layer_bytes(model.hf_config, 2)
    vllm_config = VllmConfig(model_config=model)
    # A configured layer size does not make the experts modelled.
    with pytest.raises(UnsupportedModelError):
        planned_layer_bytes(vllm_config, 1 << 30)


def test_the_audit_counts_tokens_served_not_tokens_recomputed(tmp_path: Path) -> None:
    """A prompt counts once, whole, when its prefill completes, its cached prefix included;
    then one token of output per step. A prefix computed again (a cache miss, a preemption)
    is not served twice: counting computed tokens, a level that caused recomputes would
    read as a gain, and one that saved them as a loss."""
    from dynoff.policy.scheduler import served_tokens

    scheduler = build(tmp_path, schedule=[])
    served = scheduler.offload.audit._recent  # what the audit is given, step by step
    prompt = list(range(40))
    scheduler.add_request(first := make_request(prompt))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens[first.request_id] == 40
    assert served[-1][1] == 40 + 1  # the prompt and its first token
    finish_step(scheduler, output, StepReport(1, 0, 5.0, 0, 40))
    output = scheduler.schedule()
    assert served[-1][1] == 1  # a decode step: one token
    finish_step(scheduler, output, StepReport(2, 0, 5.0, 1, 0))
    scheduler.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    # The same prompt again: two of its blocks hit the prefix cache, 8 tokens are computed,
    # and the request is served its whole prompt.
    scheduler.add_request(second := make_request(prompt))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens[second.request_id] == 8
    assert served[-1][1] == 40 + 1
    # Its 8 tokens attend the 32 cached ones and each other (the decode beside them: none).
    assert prefill_pairs(output) == 8 * 32 + 8 * 9 // 2
    # Resumed after a preemption (its prompt and first token computed again in one chunk):
    # one token of output, not the prompt a second time.
    second.append_output_token_ids(7)
    second.num_computed_tokens = 41
    assert served_tokens({second.request_id: second}, {second.request_id: 41}) == 1
    # Mid-prefill (a chunk that does not finish the prompt): nothing served yet.
    third = make_request(list(range(100, 200)))
    third.num_computed_tokens = 64
    assert served_tokens({third.request_id: third}, {third.request_id: 64}) == 0
    scheduler.shutdown()


def test_a_step_reports_the_kv_its_decodes_read(tmp_path: Path) -> None:
    """The worker reads a step's composition off vLLM's real ``SchedulerOutput``: decode
    tokens, prefill tokens, and the context the decodes' attention reads (each decoding
    request's computed tokens before the step; the policy prices the KV a level admits
    by it)."""
    scheduler = build(tmp_path, schedule=[])
    short, long_ = make_request(list(range(20))), make_request(list(range(100, 170)))
    scheduler.add_request(short)
    first = scheduler.schedule()
    assert StepShape.of(first) == (0, 20, 0)  # a prefill: no decode, no context read
    assert prefill_pairs(first) == 20 * 21 // 2  # each token attends those before it
    finish_step(scheduler, first, StepReport(scheduler.current_step, 0, 5.0, 0, 20, ()))
    scheduler.add_request(long_)  # a new request and a decoding one in the same step
    second = scheduler.schedule()
    assert StepShape.of(second) == (1, 70, 20)
    assert prefill_pairs(second) == 70 * 71 // 2
    finish_step(scheduler, second, StepReport(scheduler.current_step, 0, 5.0, 1, 70, ()))
    third = scheduler.schedule()
    assert StepShape.of(third) == (2, 0, 21 + 70)
    assert prefill_pairs(third) == 0
    scheduler.shutdown()


def test_the_policy_learns_how_long_requests_hold_their_blocks(tmp_path: Path) -> None:
    """vLLM's own ``SchedulerOutput`` tells the controller which requests a step started
    (``scheduled_new_reqs``) and which finished since the last (``finished_req_ids``): a
    request of 16 output tokens (the first sampled by its prefill) holds its blocks for the
    16 steps from its prefill to the step that reports it finished. Eight of them price a
    climb's exit."""
    scheduler = build(tmp_path, schedule=[])
    for i in range(8):
        scheduler.add_request(make_request(list(range(100 * i, 100 * i + 20))))
    steps = 0
    while scheduler.has_requests() and steps < 100:
        output = scheduler.schedule()
        decode, prefill, context = StepShape.of(output)
        report = StepReport(scheduler.current_step, 0, 5.0, decode, prefill, ())
        finish_step(scheduler, output, dataclasses.replace(report, num_context_tokens=context))
        steps += 1
    scheduler.schedule()  # reports the last finished requests
    lifetimes = scheduler.offload.lifetimes
    assert lifetimes.in_flight == 0
    assert lifetimes.exit_steps() == 16
    scheduler.shutdown()
