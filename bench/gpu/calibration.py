"""What the plugin's start-up calibration measures on this GPU, for one model.

    python3 -m bench.gpu.calibration --model /tmp/site/models/qwen3-32b \\
        --gpu-memory-utilization 0.62 --out $OUT/calibration_qwen3-32b_h200.json

Starts vLLM with the plugin's defaults (the README's serve configuration: no policy
settings, vLLM's default model runner), serves a few requests, and writes the
``calibration`` event of the trace (link, piecewise penalty, decode steps at levels 0 and 1,
the level change each way, the model's error on level 1) with the engine's start-up time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.common import write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.62)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dynoff.compile_pass.config import dynoff_compilation_config

    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    start = time.time()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        worker_cls="dynoff.compile_pass.worker.DynamicOffloadWorker",
        scheduler_cls="dynoff.policy.scheduler.DynamicOffloadScheduler",
        compilation_config=dynoff_compilation_config(),
        additional_config={"dynamic_offload": {"trace_path": str(trace)}},
    )
    startup_s = time.time() - start
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + 64 + i))) for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    del llm
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    calibration = [e for e in events if e.get("event") == "calibration"]
    result = {
        "model": args.model,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "startup_s": round(startup_s, 1),
        "calibration": calibration[0] if calibration else None,
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
