"""Run one vLLM CPU engine over a fixed workload and write its outputs as JSON (used by the
end-to-end tests, one engine per process).

    python -m bench.cpu_engine_run MODE MODEL OUT_JSON [--trace PATH] [--tp N]

MODE: ``reference`` (no offloading, the plugin's CPU linear path), ``forced`` (the plugin
with a level schedule 0 -> 2 -> 1 -> 2 -> 0 while 6 requests decode), ``forced-wrong`` (the
same, with the negative control :func:`bench.weights.wrong_partner`: offloaded layers are
copied in with their partner's weights), ``live`` (the plugin's
policy under a burst of 24 requests, then a light tail). ``--tp 2`` runs two tensor-parallel
ranks (vLLM's CPU engine binds one core per rank: set ``VLLM_CPU_OMP_THREADS_BIND``, e.g.
``0|1``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.cpu_demo import TINY_POLICY, engine_kwargs, generate, prompts
from bench.weights import EXTENSION
from dynoff.policy.trace import summarize_trace

FORCED_LEVELS = [[0, 0], [3, 2], [12, 1], [20, 2], [40, 0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["reference", "forced", "forced-wrong", "live"])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    from vllm import LLM

    offload: dict[str, Any] | None = None
    if args.mode != "reference":
        offload = {"host_page_size": 64 << 10, "trace_path": args.trace}
        if args.mode.startswith("forced"):
            offload["level_schedule"] = FORCED_LEVELS
        else:
            offload["policy"] = TINY_POLICY
    kwargs = engine_kwargs(args.model, offload, kv_bytes=4 << 20)
    if args.tp > 1:
        kwargs["tensor_parallel_size"] = args.tp
    if args.mode == "forced-wrong":
        kwargs["worker_extension_cls"] = EXTENSION
    llm = LLM(**kwargs)
    if args.mode == "forced-wrong":
        llm.collective_rpc("dynoff_wrong_partner")
    if args.mode == "live":
        outputs = generate(llm, prompts(24, 64), 64) + generate(llm, prompts(2, 16, 5), 160)
    else:
        outputs = generate(llm, prompts(6, 40), 24)
    result: dict[str, Any] = {"outputs": outputs}
    if offload is not None:  # HACK guard: the KV the forward reads lies in the VMM ranges
        result["kv_outside_vmm"] = llm.collective_rpc("dynoff_kv_outside_vmm")
    if args.trace:
        result["trace"] = summarize_trace(Path(args.trace))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
