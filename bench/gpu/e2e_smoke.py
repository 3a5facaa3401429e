"""GPU smoke test of the whole plugin in vLLM: a small generated Llama (8 layers of 30 MB),
stock vLLM vs the plugin under a forced level schedule, greedy, token identity compared.
Each engine runs in its own process.

    python3 -m bench.gpu.e2e_smoke --out $OUT/e2e_smoke_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LEVELS = [[0, 0], [3, 2], [12, 1], [20, 2]]
CAPTURE = [1, 2, 4, 8, 16]


def engine(mode: str, model: str, out: str, trace: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dynoff.compile_pass.config import dynoff_compilation_config

    kwargs: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        gpu_memory_utilization=0.15,
        max_num_seqs=16,
        compilation_config={"cudagraph_capture_sizes": CAPTURE},
    )
    if mode == "plugin":
        kwargs.update(
            worker_cls="dynoff.compile_pass.worker.DynamicOffloadWorker",
            scheduler_cls="dynoff.policy.scheduler.DynamicOffloadScheduler",
            compilation_config=dynoff_compilation_config({"cudagraph_capture_sizes": CAPTURE}),
            additional_config={"dynamic_offload": {"level_schedule": LEVELS, "trace_path": trace}},
        )
    start = time.time()
    llm = LLM(**kwargs)
    up = time.time() - start
    prompts = [
        TokensPrompt(prompt_token_ids=[(i * 31 + j * 7) % 1000 + 3 for j in range(40)])
        for i in range(6)
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    Path(out).write_text(
        json.dumps({"startup_s": up, "outputs": [list(o.outputs[0].token_ids) for o in outs]})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(*args.engine)
        return
    from bench.tiny_checkpoint import make_checkpoint

    logs = Path(args.out).parent
    work = Path("/tmp/dynoff-e2e")
    model = str(
        make_checkpoint(
            work / "llama-8x30m", layers=8, hidden=1024, intermediate=4096, heads=16, kv_heads=4
        )
    )
    results: dict[str, Any] = {"command": " ".join(sys.argv), "levels": LEVELS}
    for mode in ("stock", "plugin"):
        out, trace = work / f"{mode}.json", work / "trace.jsonl"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.gpu.e2e_smoke",
                "--out",
                args.out,
                "--engine",
                mode,
                model,
                str(out),
                str(trace),
            ],
            capture_output=True,
            text=True,
            timeout=400,
        )
        (logs / f"{mode}.log").write_text(proc.stdout[-20000:] + proc.stderr[-40000:])
        if proc.returncode != 0:
            results[mode] = {"error": proc.stderr[-3000:]}
            break
        results[mode] = json.loads(out.read_text())
    if "outputs" in results.get("plugin", {}) and "outputs" in results.get("stock", {}):
        results["token_identical"] = results["plugin"]["outputs"] == results["stock"]["outputs"]
        from dynoff.policy.trace import summarize_trace

        results["trace"] = summarize_trace(work / "trace.jsonl")
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k not in ("stock", "plugin")}))


if __name__ == "__main__":
    main()
