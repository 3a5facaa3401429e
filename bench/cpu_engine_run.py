"""Run one vLLM CPU engine over a fixed workload and write its outputs as JSON (used by the
end-to-end tests, one engine per process).

    python -m bench.cpu_engine_run MODE MODEL OUT_JSON [--trace PATH] [--tp N]

MODE: ``reference`` (no offloading, the plugin's CPU linear path), ``k0`` (the plugin held at
k = 0, the same graphs as the forced modes: the yardstick where Inductor's fusion across
the layer boundaries makes the reference's roundings differ), ``forced`` (the plugin
with a level schedule 0 -> 2 -> 1 -> 2 -> 0 while 6 requests decode), ``forced-wrong`` (the
same, with the negative control :func:`bench.weights.wrong_partner`: offloaded layers are
copied in with their partner's weights), ``live`` (the plugin's policy under a burst of 24
requests, then a light tail). The forced modes run with ``audit_changes`` on: every level
change is checked in the engine (KV groups mapped before and after keep their bytes,
resident layers their weights), and the trace counts what it found. ``--tp 2`` runs two
tensor-parallel ranks (vLLM's CPU engine binds one core per rank: set
``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``).

``k0-many`` and ``forced-many``: the plugin held at k = 0, and the plugin starting at its top
level and stepping down to 0 while 40 requests of mixed lengths (100-400 tokens in, 40-200
out) decode. The first requests' blocks land on the groups the climb mapped, the lowerings
unmap other groups and give their pages back to weights, and the requests decode on at
k = 0 over KV that moved. Both run the same graphs (the pass's ops in place), so their
outputs must agree to the last token; the reference engine has no ops, and on CPU Inductor
fuses across the layer boundaries they stand at, so its bf16 roundings differ and greedy
near ties flip in some of these longer requests.

``k0-prefix`` and ``forced-prefix``: three waves of one question on each of ten shared
documents of one KV block (:func:`prefix_waves`), three requests at a time, 8 output tokens;
held at k = 0, and steered through ``level_file``: the top level for the first wave, 0 from
the second on, so the lowerings reclaim groups that hold cached prefixes the second wave
asks for. The output adds each wave's cached prompt tokens per request
(``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from bench.cpu_demo import TINY_POLICY, engine_kwargs, generate, prompts
from bench.weights import EXTENSION
from dynoff.policy.config import PIN_HOMES
from dynoff.policy.trace import summarize_trace

FORCED_LEVELS = [[0, 0], [3, 2], [12, 1], [20, 2], [40, 0]]
MANY_LEVELS = [[0, 4], [20, 3], [30, 2], [40, 1], [50, 0]]  # the tiny model's top level is 4
PREFIX_DOC_TOKENS = 128  # one KV block of vLLM's CPU attention backend


def prefix_waves(documents: int = 10, waves: int = 3, seed: int = 1) -> list[list[list[int]]]:
    """``waves`` rounds of one question on each of ``documents`` shared documents (one full
    KV block each, so every document is a cached prefix once asked)."""
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(count)]

    docs = [tokens(PREFIX_DOC_TOKENS) for _ in range(documents)]
    return [[doc + tokens(8) for doc in docs] for _ in range(waves)]


def many_requests(count: int = 40, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs of mixed lengths that all fit level 0's KV."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 1000) for _ in range(rng.randint(100, 400))], rng.randint(40, 200))
        for _ in range(count)
    ]


def kv_groups(trace: Path) -> dict[str, Any]:
    """How many KV groups level 0 maps at start-up (groups ``0 .. n-1``), and every group a
    lowering drained for its workers to unmap, in trace order."""
    level_0, drained = 0, []
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "plan":
            level_0 = record["capacity_blocks_level_0"] // record["group_blocks"]
        for group in record.get("draining") or ():
            if group not in drained:
                drained.append(group)
    return {"level_0": level_0, "drained": drained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode",
        choices=[
            "reference",
            "k0",
            "forced",
            "forced-wrong",
            "live",
            "k0-many",
            "forced-many",
            "k0-prefix",
            "forced-prefix",
        ],
    )
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--pin-homes",
        choices=PIN_HOMES,
        default="first_raise",
        help="the plugin's pin_homes: page-lock the homes at start-up or at each level's first "
        "entry",
    )
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    many = args.mode.endswith("-many")
    prefix = args.mode.endswith("-prefix")
    level_file = Path(args.out).with_suffix(".level")
    offload: dict[str, Any] | None = None
    if args.mode != "reference":
        offload = {
            "host_page_size": 64 << 10,
            "trace_path": args.trace,
            "pin_homes": args.pin_homes,
        }
        if args.mode in ("k0", "k0-many", "k0-prefix"):
            offload["level_schedule"] = [[0, 0]]
        elif args.mode == "forced-prefix":  # steered between the waves (below)
            level_file.write_text("4")
            offload["level_file"] = str(level_file)
        elif args.mode == "forced-many":
            offload["level_schedule"] = MANY_LEVELS
        elif args.mode.startswith("forced"):
            offload["level_schedule"] = FORCED_LEVELS
        else:
            offload["policy"] = TINY_POLICY
        if args.mode.startswith("forced"):  # every change checked in the engine (debug)
            offload["audit_changes"] = True
    kwargs = engine_kwargs(args.model, offload, kv_bytes=(96 if many else 4) << 20)
    if args.tp > 1:
        kwargs["tensor_parallel_size"] = args.tp
    if args.mode == "forced-wrong":
        kwargs["worker_extension_cls"] = EXTENSION
    if prefix:  # three requests at a time fit level 0's KV: both engines batch alike
        kwargs["max_num_seqs"] = 3
    llm = LLM(**kwargs)
    if args.mode == "forced-wrong":
        llm.collective_rpc("dynoff_wrong_partner")
    if many:
        requests = many_requests()
        params = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
            for _, n in requests
        ]
        batch = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        done = llm.generate(batch, params, use_tqdm=False)
        outputs = [list(o.outputs[0].token_ids) for o in done]
    elif prefix:
        outputs, cached = [], []
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
        for wave, questions in enumerate(prefix_waves()):
            if wave == 1 and args.mode == "forced-prefix":
                level_file.write_text("0")  # lowered from 4 while the next wave runs
            batch = [TokensPrompt(prompt_token_ids=ids) for ids in questions]
            done = llm.generate(batch, greedy, use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in done]
            cached.append([int(o.num_cached_tokens or 0) for o in done])
    elif args.mode == "live":
        outputs = generate(llm, prompts(24, 64), 64) + generate(llm, prompts(2, 16, 5), 160)
    else:
        outputs = generate(llm, prompts(6, 40), 24)
    result: dict[str, Any] = {"outputs": outputs}
    if prefix:
        result["cached_tokens"] = cached
    if offload is not None:  # HACK guard: the KV the forward reads lies in the VMM ranges
        result["kv_outside_vmm"] = llm.collective_rpc("dynoff_kv_outside_vmm")
    if args.trace:
        result["trace"] = summarize_trace(Path(args.trace))
        result["kv_groups"] = kv_groups(Path(args.trace))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
