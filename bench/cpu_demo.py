"""The README's main job on a CPU: vLLM's CPU engine with dynamic offloading on a small Llama
(random weights that matter, generated on the spot), a burst of requests that fills the KV
cache and a light tail that empties it, the policy raising and lowering the offload level.

    python -m bench.cpu_demo            # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.tiny_checkpoint import make_checkpoint
from dynoff.compile_pass.config import dynoff_compilation_config
from dynoff.policy.trace import summarize_trace

# The policy scaled to this tiny engine, whose bursts last a few hundred steps: decisions 4
# steps apart, and each climb judged by the audit over 20 steps before and after it (the
# defaults, 50 and 200, are sized for a GPU's thousands of steps a minute).
TINY_POLICY = {
    "cooldown_steps": 4,
    "high_threshold": 0.8,
    "low_threshold": 0.3,
    "audit_window_steps": 20,
    "audit_settle_steps": 2,
    # The tiny model's copies cost a fraction of a millisecond a step, so a calm level may
    # take hundreds of steps to pay for its round trip (and on a busy machine, where the
    # measured stalls grow, never within a short tail): leave it after at most 24 calm steps.
    "max_calm_steps": 24,
}

WORKER = "dynoff.compile_pass.cpu_worker.CPUDynamicOffloadWorker"
REFERENCE_WORKER = "dynoff.compile_pass.cpu_worker.CPUReferenceWorker"
SCHEDULER = "dynoff.policy.scheduler.DynamicOffloadScheduler"


def engine_kwargs(model: str, offload: dict[str, Any] | None, kv_bytes: int) -> dict[str, Any]:
    """LLM(...) arguments: with ``offload`` the plugin, without it the reference engine."""
    kwargs: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
        disable_log_stats=True,
    )
    if offload is None:
        kwargs["worker_cls"] = REFERENCE_WORKER
    else:
        kwargs.update(
            worker_cls=WORKER,
            scheduler_cls=SCHEDULER,
            compilation_config=dynoff_compilation_config(route="inductor"),
            additional_config={"dynamic_offload": offload},
        )
    return kwargs


def prompts(count: int, length: int, salt: int = 0) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [
        TokensPrompt(prompt_token_ids=[(i * 31 + j * 7 + salt) % 1000 + 3 for j in range(length)])
        for i in range(count)
    ]


def generate(llm: Any, batch: list[Any], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dynoff-demo-"))
    model = str(make_checkpoint(workdir / "small-llama", layers=args.layers))
    trace = workdir / "trace.jsonl"
    offload = {
        "host_page_size": 64 << 10,
        "trace_path": str(trace),
        "policy": TINY_POLICY,
    }
    start = time.time()
    llm = LLM(**engine_kwargs(model, offload, args.kv_bytes))
    print(f"engine up in {time.time() - start:.0f} s; burst of {args.burst} requests")
    burst = generate(llm, prompts(args.burst, 64), max_tokens=64)
    print(f"burst done; light tail of 2 requests x {args.tail_tokens} tokens")
    tail = generate(llm, prompts(2, 16, salt=5), max_tokens=args.tail_tokens)
    summary = summarize_trace(trace)
    summary["requests_completed"] = sum(len(t) > 0 for t in burst + tail)
    summary["requests"] = len(burst) + len(tail)
    summary["trace"] = str(trace)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-bytes", type=int, default=4 << 20)
    parser.add_argument("--burst", type=int, default=24)
    parser.add_argument("--tail-tokens", type=int, default=160)
    parser.add_argument("--workdir", default=None)
    summary = run(parser.parse_args())
    print("\n== dynamic offload: trace summary ==")
    print(f"levels visited:        {summary['levels_visited']}")
    print(f"KV capacity by level:  {summary['capacity_blocks_by_level']} (blocks of 128 tokens)")
    print(f"level changes:         {summary['level_changes']}")
    print(f"requests completed:    {summary['requests_completed']}/{summary['requests']}")
    print(f"peak waiting queue:    {summary['max_waiting']}")
    print(f"trace:                 {summary['trace']}")


if __name__ == "__main__":
    main()
