"""Open-loop serving benchmark: Poisson arrivals into an in-process ``AsyncLLM``.

    python -m bench.serving --system dynamic --model /tmp/site/models/qwen3-32b \\
        --workload bench/workloads/sharegpt.json --rates 12 16 19 22 --staircase \\
        --window 30 --gpu-memory-utilization 0.62 --out $OUT/serving_qwen3-32b_b_dynamic_h200.json

One engine start per system; the rates run in ascending order on it. Per rate: ``--warmup``
seconds of arrivals, then a measurement window of ``--window`` seconds, then up to
``--grace`` seconds for in-flight requests to finish; the rest are aborted and the prefix
cache is reset, and every rate draws fresh prompts (no cache hits across rates).

``--staircase`` saves the drain and the refill between rates, which is most of a rate's
time when requests live tens of seconds: the next rate's arrivals start as soon as a window
ends, and its window opens ``--step-warmup`` seconds later, with the earlier requests still
in flight (the engine stays in steady state). Its queue is sampled over every request in
flight, so a backlog left by an unsustainable rate counts against the next one; the
achieved rate counts every completion inside the window. Only the last rate drains.

Systems (same model and memory, each with `vllm serve`'s defaults for the batch limits):
``stock`` (vLLM's defaults), ``stock-piecewise`` (``cudagraph_mode=PIECEWISE``: the
graph-mode cost alone), ``dynamic`` (the plugin's policy), ``static`` (the plugin held at
``--static-level``) and ``prefetch`` (vLLM's own ``PrefetchOffloader``: one layer of every
``--prefetch-group`` offloaded).

Per request: TTFT, every inter-token gap (TBT) and E2E latency. Achieved rate = requests
completed inside the window / window length. The waiting queue (arrived, no first token yet)
is sampled every ``--sample`` seconds; **a rate is sustainable when the queue does not grow
over the window: the least-squares slope of its samples stays below 2% of the offered
rate**, and the maximum sustainable rate is the highest achieved rate among sustainable
rates. Arrivals and prompts depend on the rate alone, so every system sees the same ones.
For the plugin's systems the trace (level, KV utilisation, queue, the policy's decision, the
step's forward time and tokens) is sampled every step.
Runs on vLLM's CPU engine too (``--cpu``: a generated Llama, ``stock`` = the reference
worker, ``dynamic``/``static`` = the plugin).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import model_or_generated, nearest_rank, write_results
from bench.workloads import prompt_ids

SYSTEMS = ("stock", "stock-piecewise", "dynamic", "static", "prefetch")
PLUGIN_SYSTEMS = ("dynamic", "static")
SLOPE_FRACTION = 0.02
DEFINITION = (
    "achieved rate = requests completed inside the window / window length; a rate is "
    "sustainable when the waiting queue (arrived, no first token yet) does not grow over the "
    "window: the least-squares slope of its samples is below 2% of the offered rate "
    "(requests/s), i.e. fewer than 1 in 50 offered requests pile up; max sustainable rate = "
    "highest achieved rate among sustainable rates"
)


def engine_kwargs(args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    offload: dict[str, Any] = {"trace_path": str(trace)}
    if args.system == "static":
        offload["level_schedule"] = [[0, args.static_level]]
    if args.policy:
        offload["policy"] = json.loads(args.policy)
    if args.cpu:
        from bench.cpu_demo import engine_kwargs as cpu_kwargs

        if args.system not in ("stock", *PLUGIN_SYSTEMS):
            raise SystemExit(f"--cpu supports stock, dynamic and static, not {args.system}")
        plugin = args.system in PLUGIN_SYSTEMS
        return cpu_kwargs(
            args.model, {**offload, "host_page_size": 64 << 10} if plugin else None, args.kv_bytes
        )
    kwargs: dict[str, Any] = dict(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        seed=0,
    )
    if args.system == "stock-piecewise":
        kwargs["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    elif args.system == "prefetch":
        kwargs.update(
            offload_group_size=args.prefetch_group,
            offload_num_in_group=1,
            offload_prefetch_step=2,
        )
    elif args.system in PLUGIN_SYSTEMS:
        from dynoff.compile_pass.config import dynoff_compilation_config

        kwargs.update(
            worker_cls="dynoff.compile_pass.worker.DynamicOffloadWorker",
            scheduler_cls="dynoff.policy.scheduler.DynamicOffloadScheduler",
            compilation_config=dynoff_compilation_config(route=args.route),
            additional_config={"dynamic_offload": offload},
        )
    return kwargs


class Request:
    __slots__ = ("arrival", "done", "first", "gaps", "last", "rid", "tokens")

    def __init__(self, arrival: float, rid: str) -> None:
        self.arrival, self.rid = arrival, rid
        self.first: float | None = None
        self.last: float | None = None
        self.done: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0


async def one_request(engine: Any, ids: list[int], output: int, req: Request) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=output,
        temperature=0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, req.rid):
        now = time.monotonic()
        new = len(out.outputs[0].token_ids)
        if new:
            if req.first is None:
                req.first = now
            elif req.last is not None:
                req.gaps += [(now - req.last) / new] * new
            req.last = now
            req.tokens += new
        if out.finished:
            req.done = now


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(nearest_rank(ordered, q) * 1e3, 2)


def _quantiles(values: list[float], points: int = 100) -> list[float]:
    """``points`` evenly spaced quantiles (ms), for CDF plots."""
    if not values:
        return []
    ordered = sorted(values)
    return [round(nearest_rank(ordered, i / points) * 1e3, 2) for i in range(points + 1)]


class Step:
    """One rate of the sweep: its arrivals, its requests and the queue samples."""

    def __init__(self, rate: float, salt: int, start: float, warmup: float, window: float):
        self.rate, self.salt, self.start = rate, salt, start
        self.warmup = warmup
        self.window_start, self.window_end = start + warmup, start + warmup + window
        self.requests: list[Request] = []
        self.samples: list[tuple[float, int, int]] = []


async def run_step(
    engine: Any,
    workload: list[dict[str, Any]],
    step: Step,
    inflight: list[Request],
    tasks: list[asyncio.Task[None]],
    args: argparse.Namespace,
) -> None:
    """Poisson arrivals at ``step.rate`` until the window ends. ``inflight`` holds every
    request not yet finished, earlier steps' included: the queue is sampled over all of them,
    so a backlog carried into a staircase step counts against it."""
    from tqdm import tqdm

    rng = random.Random(step.salt)
    order = list(range(len(workload)))
    rng.shuffle(order)
    arrivals, t = [], step.start
    while True:
        t += rng.expovariate(step.rate)
        if t >= step.window_end:
            break
        arrivals.append(t)

    async def launch() -> None:
        for n, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            spec = workload[order[n % len(order)]]
            salt = step.salt * 10_000_000
            segments = [[seed + salt, length] for seed, length in spec["segments"]]
            req = Request(time.monotonic(), f"r{step.salt}-{n}")
            step.requests.append(req)
            inflight.append(req)
            ids = prompt_ids(segments, args.vocab)
            tasks.append(asyncio.create_task(one_request(engine, ids, spec["output"], req)))

    launcher = asyncio.create_task(launch())
    total = round(step.window_end - step.start)
    bar = tqdm(total=total, desc=f"{step.rate:g} req/s", unit="s", leave=False)
    while time.monotonic() < step.window_end:
        await asyncio.sleep(args.sample)
        inflight[:] = [r for r in inflight if r.done is None]
        waiting = sum(r.first is None for r in inflight)
        running = len(inflight) - waiting
        step.samples.append((round(time.monotonic() - step.start, 3), waiting, running))
        bar.n = min(total, round(time.monotonic() - step.start))
        bar.refresh()
    bar.close()
    await launcher


async def drain(
    engine: Any, inflight: list[Request], tasks: list[asyncio.Task[None]], grace: float
) -> int:
    """Up to ``grace`` seconds for in-flight requests to finish; the rest are aborted."""
    grace_end = time.monotonic() + grace
    while time.monotonic() < grace_end and any(r.done is None for r in inflight):
        await asyncio.sleep(0.2)
    unfinished = [r.rid for r in inflight if r.done is None]
    if unfinished:
        await engine.abort(unfinished)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    inflight.clear()
    tasks.clear()
    return len(unfinished)


def rate_salt(rate: float) -> int:
    return round(rate * 1000) + 1


def queue_slope(samples: Sequence[Sequence[float]], t0: float, t1: float) -> float:
    """Least-squares slope (requests/s) of the waiting queue sampled inside [t0, t1)."""
    points = [(s[0], s[1]) for s in samples if t0 <= s[0] < t1]
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_q = statistics.fmean(q for _, q in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (q - mean_q) for t, q in points) / var if var else 0.0


def sustainable(slope: float, rate: float) -> bool:
    return slope < SLOPE_FRACTION * rate


def max_sustainable_rate(rates: list[dict[str, Any]]) -> float | None:
    """The highest achieved rate among the sustainable ones, or None."""
    return max((r["achieved_rate"] for r in rates if r["sustainable"]), default=None)


def summarize(step: Step, everyone: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """The step's figures. Achieved rate counts every completion inside the window (a
    staircase step also completes requests that arrived before it); latencies are those of
    the requests that arrived inside the window."""
    measured = [r for r in step.requests if step.window_start <= r.arrival < step.window_end]
    completed_in_window = sum(
        1 for r in everyone if r.done is not None and step.window_start <= r.done < step.window_end
    )
    done = [r for r in measured if r.done is not None]
    ttft = [r.first - r.arrival for r in done if r.first is not None]
    tbt = [g for r in done for g in r.gaps]
    e2e = [r.done - r.arrival for r in done if r.done is not None]
    slope = queue_slope(step.samples, step.warmup, step.warmup + args.window)
    arrivals_in_window = len(measured)
    return {
        "target_rate": step.rate,
        "achieved_rate": round(completed_in_window / args.window, 3),
        "arrivals_in_window": arrivals_in_window,
        "completed_in_window": completed_in_window,
        "measured_completed": len(done),
        "measured_unfinished": len(measured) - len(done),
        "output_tokens_per_s": round(sum(r.tokens for r in done) / args.window, 1),
        "queue_slope": round(slope, 3),
        "sustainable": sustainable(slope, step.rate),
        "ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "tbt_ms": {"p50": _pct(tbt, 0.5), "p99": _pct(tbt, 0.99)},
        "e2e_ms": {"p50": _pct(e2e, 0.5), "p99": _pct(e2e, 0.99)},
        "cdf_ms": {"ttft": _quantiles(ttft), "tbt": _quantiles(tbt), "e2e": _quantiles(e2e)},
        "queue_samples": step.samples,
        "window": [round(step.warmup, 3), round(step.warmup + args.window, 3)],
    }


STEP_KEYS = ("t", "step", "level", "kv_util", "waiting", "running", "decision", "latency_ms")
FORWARD_KEYS = ("forward_ms", "decode_tokens", "prefill_tokens")


def timed_forward(record: dict[str, Any]) -> bool:
    """A sampled step that carries a finished forward: a time and at least one token (the
    rule of ``StepReport.timed``, for traces read back from a results file)."""
    tokens = record.get("decode_tokens", 0) + record.get("prefill_tokens", 0)
    return record.get("forward_ms", 0) > 0 and tokens > 0


def trace_series(trace: Path, limit: int = 4000) -> list[dict[str, Any]]:
    """The plugin trace's per-step records, thinned: level, KV utilisation, queue, the
    policy's decision and the estimates it weighed, and, once the step's forward has been
    reported, its time and token counts (what the cost model is fitted to)."""
    if not trace.exists():
        return []
    steps, forwards = [], {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "step":
            steps.append({k: record[k] for k in STEP_KEYS if k in record})
        elif record.get("kind") == "forward":
            forwards[record["step"]] = {k: record[k] for k in FORWARD_KEYS}
    stride = max(1, len(steps) // limit)
    return [{**s, **forwards.get(s["step"], {})} for s in steps[::stride]]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    workload = json.loads(Path(args.workload).read_text())
    workdir = Path(tempfile.mkdtemp(prefix="dynoff-serving-"))
    trace = workdir / "trace.jsonl"
    started = time.monotonic()
    # `vllm serve`'s defaults (on an H200: max_num_seqs 1024, max_num_batched_tokens 8192),
    # not the in-process engine's (128, 2048), under which the batch cap binds before the KV
    # cache does
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_kwargs(args, trace)),
        usage_context=UsageContext.OPENAI_API_SERVER,
    )
    startup_s = time.monotonic() - started
    config = engine.vllm_config
    args.vocab = min(30000, config.model_config.get_vocab_size())
    results: dict[str, Any] = {
        "system": args.system,
        "model": args.model,
        "workload": {k: v for k, v in workload.items() if k != "requests"},
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "definition": DEFINITION,
        "startup_s": round(startup_s, 1),
        "engine": {
            "usage_context": "OPENAI_API_SERVER",
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "kv_cache_blocks": config.cache_config.num_gpu_blocks,
            "block_size": config.cache_config.block_size,
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        },
        "settings": {
            k: getattr(args, k)
            for k in (
                "window",
                "warmup",
                "step_warmup",
                "staircase",
                "grace",
                "static_level",
                "route",
                "policy",
            )
        },
        "rates": [],
        "aborted": 0,
    }
    if args.system == "prefetch":
        results["settings"]["prefetch_group"] = args.prefetch_group
    steps: list[Step] = []
    everyone: list[Request] = []
    inflight: list[Request] = []
    tasks: list[asyncio.Task[None]] = []

    def measured() -> list[dict[str, Any]]:
        return [summarize(step, everyone, args) for step in steps]

    try:
        for n, rate in enumerate(tqdm(sorted(args.rates), desc=args.system, unit="rate")):
            staircase_step = args.staircase and n > 0
            if not staircase_step:
                await engine.reset_prefix_cache()
            warmup = args.step_warmup if staircase_step else args.warmup
            # the salt depends on the rate alone: every system sees the same arrival times
            # and the same prompts at a given rate
            step = Step(rate, rate_salt(rate), time.monotonic(), warmup, args.window)
            steps.append(step)
            await run_step(engine, workload["requests"], step, inflight, tasks, args)
            everyone += step.requests
            last = n == len(args.rates) - 1
            if not args.staircase or last:
                results["aborted"] += await drain(engine, inflight, tasks, args.grace)
            # earlier staircase steps' latencies grow as their requests finish: all again
            rates = measured()
            entry = rates[-1]
            # a crash or a device time limit later keeps the rates measured so far
            write_results(args.out, {**results, "rates": rates, "partial": True})
            tqdm.write(
                json.dumps(
                    {
                        k: entry[k]
                        for k in ("target_rate", "achieved_rate", "sustainable", "queue_slope")
                    }
                    | {"ttft_p50": entry["ttft_ms"]["p50"], "tbt_p50": entry["tbt_ms"]["p50"]}
                )
            )
            if args.stop_after_unsustainable and not entry["sustainable"]:
                if inflight:
                    results["aborted"] += await drain(engine, inflight, tasks, args.grace)
                break
        results["rates"] = measured()
    finally:
        engine.shutdown()
    results["max_sustainable_rate"] = max_sustainable_rate(results["rates"])
    if args.system in PLUGIN_SYSTEMS:
        results["trace"] = trace_series(trace)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--window", type=float, default=90.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument(
        "--staircase",
        action="store_true",
        help="raise the rate without draining between rates (see the module docstring)",
    )
    parser.add_argument(
        "--step-warmup", type=float, default=10.0, help="staircase: seconds before each window"
    )
    parser.add_argument("--sample", type=float, default=0.5)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--static-level", type=int, default=4)
    parser.add_argument("--prefetch-group", type=int, default=8)
    parser.add_argument("--route", choices=["partition", "split"], default="split")
    parser.add_argument("--policy", default=None, help="JSON of policy settings (plugin)")
    parser.add_argument("--stop-after-unsustainable", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU engine, generated model")
    parser.add_argument("--kv-bytes", type=int, default=4 << 20, help="CPU KV cache bytes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model_or_generated(parser, args)
    results = asyncio.run(run(args))
    write_results(args.out, results)
    print(json.dumps({k: results[k] for k in ("system", "max_sustainable_rate", "startup_s")}))


if __name__ == "__main__":
    main()
