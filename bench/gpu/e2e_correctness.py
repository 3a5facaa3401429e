"""GPU end-to-end check of the plugin inside vLLM (issue #5), one engine per process.

    python3 -m bench.gpu.e2e_correctness --model /tmp/site/models/qwen3-8b \\
        --out $OUT/e2e_correctness_h200.json [--phase identity|live]

``identity`` runs engines over the same requests (ShareGPT-like lengths, greedy, dummy
weights made distinct per layer by :func:`bench.weights.distinct_weights` unless ``--weights
dummy``): ``stock`` vLLM (its defaults, FULL_AND_PIECEWISE), ``partition`` (stock with the
partition route's Inductor partitioning but no pass), ``split`` (stock with the split route:
the ops inserted and split at, but no plugin, so they do nothing), ``k0`` (the plugin held
at k = 0, no trace), ``forced`` (the plugin under a schedule 0 -> max -> 0 while the
requests decode) and ``forced-wrong`` (the negative control: ``forced`` with every offloaded
layer copied in with its partner's weights, :func:`bench.weights.wrong_partner`; it must
differ from stock, or the identity check could not see a wrong layer). ``k0-pw``, ``forced-pw``
and ``forced-wrong-pw`` (and ``stock-pw``) are the same with ``cudagraph_mode=PIECEWISE``;
``forced0-pw`` is ``forced-pw``'s configuration (trace, level bound, audit) held at 0, which
tells whether a difference between ``k0-pw`` and ``forced-pw`` comes from the level changes or
from the configuration. ``forced`` runs its k > 0 steps piecewise and its k = 0 steps on FULL
graphs, and the two graph modes need not agree to the last bit: on the H100, with distinct
weights, ``forced`` left 3 of 256 requests 30-50 steps after its last level change. On one graph
mode, with the same graphs and the same batches, ``forced-pw`` must give ``k0-pw``'s tokens
exactly: a lost KV page or a wrong layer would show there. ``stock-pw`` is no yardstick for it:
on the H100 (2026-12-06) stock's piecewise mode moved 239 of 256 requests away from stock's
default graph mode, from the first tokens, while every plugin engine (``k0``, ``forced``,
``forced-pw``) stayed within 4 of 256 of stock (why is not known); it measures vLLM's own graph
modes. Those differences, and ``k0-pw`` against ``forced0-pw`` (240 of 256, two configurations
held at 0), came from Inductor, not from the plugin: each configuration compiles its own
kernels, and Inductor times several block shapes for every reduction kernel (RMSNorm's among
them) and keeps the fastest, whose summation order then sets the last bits. With weights that
make every layer count, the last bits flip greedy tokens. On the H100 (2026-12-06)
``forced0-pw`` and ``forced-pw`` ran the very same batches, and 240 of 256 requests differed,
12 of them from their first token, which both engines computed at level 0 before any change. So
the identity phase compiles every engine alike without timing: reductions take Inductor's one
filtered configuration (``TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS=1``, the config its
deterministic mode uses) and horizontal fusion is kept without its benchmark
(:data:`UNTIMED_INDUCTOR`). Every engine sees the same first batch on a cold prefix cache; KV
capacity is ample at every level, so all engines schedule the same batches. For that the
identity phase runs vLLM's engine core in the generating process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that all the requests are queued before the first
step: with the core in its own process the first step starts when the first few requests have
arrived (1 or 4 of 256 on the H100, 2026-12-06), the batches then differed from step 1 between
``forced0-pw`` and ``forced-pw``, and 1 of 256 requests differed at position 220, which that
pair could not lay on the batches or on the level changes.
Each plugin engine's schedule (waiting and running
requests per step, from its trace) is reported beside the tokens (``schedules``): a pair
compared on different batches says so. It reports token identity between them,
the k = 0 throughput ratio (best of ``--repeats`` batches, distinct prompts each, after a
warm-up) and the decode step time at batch ``--decode-batch`` (median of 3). Engines can be
split over several calls on one warm machine (``--engines``): each engine's result stays in
``/tmp/dynoff-e2e-correctness`` and every call reports on all found there.

``live`` runs the plugin's policy with a small KV budget under a burst, then a light tail:
the level should climb under pressure and come back down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import read_results, write_results

CAPTURE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
WORKER = "dynoff.compile_pass.worker.DynamicOffloadWorker"
PIECEWISE = "-pw"  # a mode's suffix: the same engine with cudagraph_mode=PIECEWISE
PIECEWISE_MODES = ("stock-pw", "k0-pw", "forced0-pw", "forced-pw", "forced-wrong-pw")
SCHEDULER = "dynoff.policy.scheduler.DynamicOffloadScheduler"


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs with ShareGPT-like lengths."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 30000) for _ in range(rng.randint(32, 512))], rng.randint(32, 256))
        for _ in range(count)
    ]


def forced_schedule(max_level: int) -> list[list[int]]:
    """0 -> max in four steps while the batch prefills and decodes, hold, then back to 0."""
    ups = sorted({max(1, round(max_level * f)) for f in (0.25, 0.5, 0.75, 1.0)})
    schedule = [[0, 0]] + [[12 + 8 * n, level] for n, level in enumerate(ups)]
    downs = [*reversed(ups[:-1]), 0]
    start = 12 + 8 * len(ups) + 60
    return schedule + [[start + 8 * n, level] for n, level in enumerate(downs)]


# The identity phase's compilation: vLLM's default horizontal fusion (``combo_kernels``),
# without the benchmark that picks it per kernel group by timing. With the environment below,
# the engines of a pair compile the same kernels with the same configurations.
UNTIMED_INDUCTOR = {"combo_kernels": True, "benchmark_combo_kernel": False}
UNTIMED_ENV = {"TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS": "1"}


ENGINE_TIMEOUT_S = 580.0
LOG_HEAD, LOG_TAIL = 20_000, 80_000  # what an engine's log keeps, in characters


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int | None:
    """Run one engine's process with its output streamed to ``log`` as it comes, so that a
    run cut short keeps what it printed (the H100's twelfth-session calls lost an engine's
    whole log to an outer ``timeout``: it was written only when the process ended). Returns
    the exit code, or None when ``timeout_s`` ran out: then the engine and every process it
    started (vLLM's engine core) are killed, and nothing is left holding the GPU. The log
    keeps its first and last characters (``LOG_HEAD``, ``LOG_TAIL``)."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:  # also on the orchestrator's own interruption; and orphans of an exit
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            text = log.read_text(errors="replace")
            if len(text) > LOG_HEAD + LOG_TAIL:
                cut = len(text) - LOG_HEAD - LOG_TAIL
                log.write_text(
                    f"{text[:LOG_HEAD]}\n[... {cut} characters cut ...]\n{text[-LOG_TAIL:]}"
                )


def compiled_untimed(compilation_config: dict[str, Any]) -> bool:
    """Whether this process compiles without Inductor's timing (:data:`UNTIMED_ENV` read at
    Inductor's import, :data:`UNTIMED_INDUCTOR` in the engine's configuration): a pair's
    token identity is only asked of engines compiled so."""
    import torch._inductor.config as inductor

    return bool(inductor.test_configs.force_filter_reduction_configs) and (
        compilation_config.get("inductor_compile_config") == UNTIMED_INDUCTOR
    )


def engine_env(phase: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment an engine's process runs in."""
    env = dict(environ)
    if phase == "identity":  # every request queued before the first step, kernels alike
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(UNTIMED_ENV)
    return env


def engine_kwargs(mode: str, model: str, trace: str, args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        max_num_seqs=256,
        gpu_memory_utilization=args.gpu_memory_utilization,
        compilation_config={"cudagraph_capture_sizes": CAPTURE},
        disable_log_stats=True,
    )
    if args.phase == "identity":  # no kernel chosen by timing: see the module's docstring
        kwargs["compilation_config"]["inductor_compile_config"] = dict(UNTIMED_INDUCTOR)
    if args.kv_offloading_size:  # vLLM's CPU KV tier, on every engine alike
        kwargs["kv_offloading_size"] = args.kv_offloading_size
    if args.weights == "distinct" or mode.startswith("forced-wrong"):
        from bench.weights import EXTENSION

        kwargs["worker_extension_cls"] = EXTENSION
    graphs = kwargs["compilation_config"]
    if mode.endswith(PIECEWISE):  # stock-pw, forced-pw, ...: every step piecewise
        graphs["cudagraph_mode"] = "PIECEWISE"
        mode = mode.removesuffix(PIECEWISE)
    if mode == "stock":
        return kwargs
    from dynoff.compile_pass.config import dynoff_compilation_config

    if mode in ("partition", "split"):  # the route's compilation alone, no plugin
        config = dynoff_compilation_config(dict(graphs), mode)
        if mode == "partition":  # Inductor partitioning only: no pass, no ops
            config.pop("inductor_passes")
        # split: the ops are inserted and split at, and do nothing without the plugin
        kwargs["compilation_config"] = config
        return kwargs

    offload: dict[str, Any] = {"trace_path": trace}
    if mode == "k0":  # as served: no trace (the one at k = 0 would only say "0")
        offload = {"level_schedule": [[0, 0]]}
    elif mode in ("forced", "forced-wrong", "forced0"):  # forced0: the same, held at 0
        schedule = forced_schedule(args.max_level) if mode != "forced0" else [[0, 0]]
        offload["level_schedule"] = schedule
        offload["policy"] = {"max_level": args.max_level}
        offload["audit_changes"] = args.audit
    else:  # live
        offload["policy"] = {
            "max_level": args.max_level,
            "cooldown_steps": 10,
            "high_threshold": 0.85,
            "low_threshold": 0.4,
        }
        kwargs["gpu_memory_utilization"] = args.live_memory_utilization
    kwargs.update(
        worker_cls=WORKER,
        scheduler_cls=SCHEDULER,
        compilation_config=dynoff_compilation_config(graphs, route=args.route),
        additional_config={"dynamic_offload": {**offload, "kv_layout": args.kv_layout}},
    )
    return kwargs


def run_engine(mode: str, model: str, out: Path, trace: Path, args: argparse.Namespace) -> None:
    """One engine (in its own process): time it over the workload, write outputs as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    kwargs = engine_kwargs(mode, model, str(trace), args)
    llm = LLM(**kwargs)
    base = mode.removesuffix(PIECEWISE)
    result: dict[str, Any] = {"mode": mode, "startup_s": round(time.time() - start, 1)}
    result["compiled_untimed"] = compiled_untimed(kwargs["compilation_config"])
    if args.weights == "distinct":
        result["weights_redrawn"] = llm.collective_rpc("dynoff_distinct_weights")
    if base == "forced-wrong":
        llm.collective_rpc("dynoff_wrong_partner")

    def generate(batch: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in batch]
        params = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
            for _, n in batch
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    requests = workload(args.requests)
    result["output_tokens"] = sum(n for _, n in requests)
    if mode == "live":
        burst = workload(args.requests, seed=1)
        elapsed, outputs = generate(burst)
        _, tail = generate([(ids[:64], 400) for ids, _ in requests[:2]])
        result.update(burst_s=elapsed, outputs=outputs + tail)
    elif base in ("forced", "forced-wrong", "forced0"):
        elapsed, outputs = generate(requests)  # first: the schedule counts engine steps
        result.update(seconds=[elapsed], outputs=outputs)
        # HACK guard in the real engine: no step that needed the ops went to a FULL graph.
        result["dispatches"] = llm.collective_rpc("dynoff_dispatches")
    elif mode != base:  # stock-pw: the reference for the outputs only, not timed
        elapsed, outputs = generate(requests)
        result.update(seconds=[elapsed], outputs=outputs)
    else:
        _, outputs = generate(requests)  # cold prefix cache, as every engine sees it
        generate(workload(32, seed=99))  # warm-up
        seconds = [generate(workload(args.requests, seed=1 + r))[0] for r in range(args.repeats)]
        result.update(seconds=seconds, outputs=outputs)
        # Decode step time: the same batch with 1 and with 1 + T output tokens.
        decode = []
        for r in range(3):
            ids = [
                [(i * 131 + j + r) % 30000 + 3 for j in range(32)] for i in range(args.decode_batch)
            ]
            t1, _ = generate([(prompt, 1) for prompt in ids])
            t2, _ = generate([(prompt, 1 + args.decode_tokens) for prompt in ids])
            decode.append((t2 - t1) / args.decode_tokens * 1e3)
        result["decode_ms_samples"] = [round(d, 3) for d in decode]
        result["decode_ms"] = round(sorted(decode)[1], 3)
    out.write_text(json.dumps(result))


def batch_schedule(records: list[dict[str, Any]]) -> list[list[int]]:
    """[waiting, running] after each step's schedule, in step order, from a plugin trace."""
    steps = {
        row["step"]: [row["waiting"], row["running"]]
        for row in records
        if row.get("kind") == "step"
    }
    return [steps[s] for s in sorted(steps)]


def engine_trace(trace: Path, logs: Path, mode: str) -> dict[str, Any]:
    """An engine's trace, read once: its summary and its schedule; its tail is kept beside
    the logs."""
    from dynoff.policy.trace import summarize_records

    text = trace.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    (logs / f"{mode}_trace.jsonl").write_text(text[-2_000_000:])
    return {"trace": summarize_records(records), "schedule": batch_schedule(records)}


def schedule_divergence(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Whether two engines scheduled the same batches, and the first step they did not."""
    first = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"identical": first is None, "first_step": None if first is None else first + 1}


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    differing = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    positions = [
        next(p for p, (s, t) in enumerate(zip(a[i], b[i], strict=False)) if s != t)
        if len(a[i]) == len(b[i])
        else -1
        for i in differing
    ]
    return {"requests_differing": len(differing), "first_positions": positions[:20]}


def compare(engines: dict[str, Any], outputs: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Token identity between engines, the k = 0 ratios and the forced/live trace figures.
    ``stock_2`` (a second stock engine, see ``--combine``) checks stock's own determinism;
    any other ``<mode>_2`` is compared with its first run and with stock."""
    pairs = [("forced", "k0"), ("k0", "stock"), ("forced", "stock"), ("partition", "stock")]
    pairs += [("k0", "partition"), ("stock_2", "stock"), ("k0", "stock_2")]
    pairs += [("split", "stock"), ("k0", "split"), ("forced-wrong", "stock")]
    # One graph mode throughout: the plugin's piecewise graphs, held at 0 and forced.
    pairs += [("forced-pw", "k0-pw"), ("k0-pw", "k0"), ("forced-pw", "forced")]
    pairs += [
        ("forced-pw", "stock"),
        ("forced-wrong-pw", "k0-pw"),
        ("forced-wrong-pw", "forced-pw"),
    ]
    pairs += [("stock-pw", "stock"), ("forced-pw", "stock-pw")]  # vLLM's own graph modes
    # The forced engine's configuration held at 0: the same engine without its level changes.
    pairs += [("forced0-pw", "forced-pw"), ("forced0-pw", "k0-pw"), ("forced0-pw", "stock")]
    pairs += [("forced-wrong-pw", "forced0-pw")]
    for second in [m for m in outputs if m.endswith("_2") and m != "stock_2"]:  # --combine
        pairs += [(second, second[:-2]), (second, "stock")]
    report: dict[str, Any] = {
        "identity": {
            f"{a}_vs_{b}": {
                "identical": outputs[a] == outputs[b],
                **first_divergence(outputs[a], outputs[b]),
            }
            for a, b in pairs
            if a in outputs and b in outputs
        }
    }
    report["schedules"] = {
        f"{a}_vs_{b}": schedule_divergence(engines[a]["schedule"], engines[b]["schedule"])
        for a, b in pairs
        if "schedule" in engines.get(a, {}) and "schedule" in engines.get(b, {})
    }
    if "stock" in outputs:
        report["requests"] = len(outputs["stock"])
        if "forced" in outputs:
            report["token_identical"] = outputs["forced"] == outputs["stock"]
    if "forced-wrong" in outputs and "stock" in outputs:  # must be seen to differ
        report["negative_control_detected"] = outputs["forced-wrong"] != outputs["stock"]
    # One graph mode throughout, the plugin's graphs: forced against the same configuration
    # held at 0 (forced0-pw), or, in reports before it existed, against k0-pw.
    held = "forced0-pw" if "forced0-pw" in outputs else "k0-pw"
    if held in outputs:
        if "forced-pw" in outputs:
            report["token_identical_piecewise"] = outputs["forced-pw"] == outputs[held]
        if "forced-wrong-pw" in outputs:
            wrong = outputs["forced-wrong-pw"]
            report["negative_control_piecewise_detected"] = wrong != outputs[held]
        report["piecewise_pair"] = f"forced-pw_vs_{held}"
    if "stock" in engines and "k0" in engines and "seconds" in engines["k0"]:
        stock_s, k0_s = min(engines["stock"]["seconds"]), min(engines["k0"]["seconds"])
        report["k0_throughput_ratio"] = round(stock_s / k0_s, 4)
        report["stock_decode_ms"] = engines["stock"]["decode_ms"]
        report["k0_decode_ms"] = engines["k0"]["decode_ms"]
        report["k0_ratio"] = round(engines["stock"]["decode_ms"] / engines["k0"]["decode_ms"], 4)
    for mode in ("forced-pw", "forced", "live"):  # the last one found is reported
        if "trace" in engines.get(mode, {}):
            trace = engines[mode]["trace"]
            report["level_changes"] = trace["level_changes"]
            report["max_level_reached"] = max(trace["levels_visited"])
            report["levels_visited"] = trace["levels_visited"]
            report["resize_failures"] = trace["resize_failures"]
            if "audit_failures" in trace:
                report["audit_failures"] = trace["audit_failures"]
    return report


def combine(paths: list[str]) -> dict[str, Any]:
    """One report from the results of several calls (each ``X.json`` with its
    ``X.outputs.json``), when the engines did not all run on one machine. A mode seen twice
    is kept as ``<mode>_2``."""
    engines: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    calls = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        found_at = Path(path).with_suffix(".outputs.json")
        if not found_at.exists():  # committed gzip-compressed under bench/results/
            found_at = found_at.with_name(found_at.name + ".gz")
        found = read_results(found_at)
        calls.append({"command": result["command"], "machine": result["machine"]})
        for mode, engine in result["engines"].items():
            name = mode if mode not in engines else f"{mode}_2"
            engines[name] = engine
            if mode in found:
                outputs[name] = found[mode]
    combined = json.loads(Path(paths[0]).read_text())
    for key in ("command", "machine", "identity", "requests", "token_identical"):
        combined.pop(key, None)
    combined.update(calls=calls, engines=engines, **compare(engines, outputs))
    return combined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=["identity", "live"], default="identity")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-level", type=int, default=18)
    parser.add_argument("--decode-batch", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--engines", nargs="+", default=None, help="subset of the phase's")
    parser.add_argument("--route", choices=["partition", "split"], default="split")
    parser.add_argument(
        "--kv-layout",
        choices=["auto", "per_layer", "packed"],
        default="auto",
        help="the plugin engines' kv_layout (default: the plugin's own, auto; packed: large "
        "pages, vLLM's packed KV layout)",
    )
    parser.add_argument(
        "--weights",
        choices=["distinct", "dummy"],
        default="distinct",
        help="distinct: each decoder layer's matrices redrawn, distinct and O(1/sqrt(fan-in)) "
        "(bench.weights); dummy: vLLM's own, identical in every layer",
    )
    parser.add_argument(
        "--audit",
        action="store_true",
        help="the forced engines check every level change on the device (audit_changes: "
        "KV groups mapped before and after keep their bytes, resident layers their weights)",
    )
    parser.add_argument("--workdir", default="/tmp/dynoff-e2e-correctness")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--live-memory-utilization", type=float, default=0.2)
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of vLLM's CPU KV tier (its OffloadingConnector) on every engine",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="seconds the whole run may take (a device call's limit, less what follows it): "
        "an engine still running then is killed with its engine core, its log and trace "
        "kept, and the report is written over the engines that finished",
    )
    parser.add_argument("--engine", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--combine", nargs="+", default=None, help="result JSONs of several calls")
    args = parser.parse_args()
    if args.combine:
        write_results(args.out, combine(args.combine))
        return
    if args.model is None:
        parser.error("--model is required")
    if args.engine:
        mode, out, trace = args.engine
        run_engine(mode, args.model, Path(out), Path(trace), args)
        return

    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    signal.signal(signal.SIGTERM, _terminated)  # an outer `timeout`: clean up, then report
    logs = Path(args.out).parent
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    identity_modes = ["stock", "split", "partition", "k0", "forced"]
    modes = identity_modes if args.phase == "identity" else ["live"]
    results: dict[str, Any] = {
        "phase": args.phase,
        "model": args.model,
        "route": args.route,
        "kv_layout": args.kv_layout,
        "weights": args.weights,
        "kv_offloading_size": args.kv_offloading_size,
        "audit_changes": args.audit,
        "engines": {},
    }
    try:
        run_engines(args.engines or modes, args, work, logs, deadline, results)
    finally:
        report(args, modes, work, results)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_engines(
    modes: list[str],
    args: argparse.Namespace,
    work: Path,
    logs: Path,
    deadline: float | None,
    results: dict[str, Any],
) -> None:
    """Each engine in its own process, in order, until one fails or the deadline nears."""
    for mode in modes:
        out, trace = work / f"{mode}.json", work / f"{mode}.jsonl"
        trace.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.gpu.e2e_correctness", *sys.argv[1:]]
        cmd += ["--engine", mode, str(out), str(trace)]
        left = ENGINE_TIMEOUT_S if deadline is None else deadline - time.monotonic()
        if left < 30:
            results["engines"][mode] = {"error": f"not started: {left:.0f} s left of the deadline"}
            print(f"[e2e] engine {mode} not started: the deadline is near", flush=True)
            break
        print(f"[e2e] engine {mode} ...", flush=True)
        env = engine_env(args.phase, os.environ)
        log = logs / f"{mode}.log"
        timeout_s = min(left, ENGINE_TIMEOUT_S)
        code = run_logged(cmd, env, log, timeout_s)
        if code != 0:
            reason = f"exit code {code}" if code is not None else f"killed after {timeout_s:.0f} s"
            tail = log.read_text(errors="replace")[-3000:]
            results["engines"][mode] = {"error": f"{reason}\n{tail}"}
            if trace.exists():  # how far it got
                results["engines"][mode].update(engine_trace(trace, logs, mode))
            print(f"[e2e] engine {mode} failed ({reason}):\n{tail}", flush=True)
            break
        result = json.loads(out.read_text())
        if trace.exists():
            result.update(engine_trace(trace, logs, mode))
        results["engines"][mode] = result
        out.write_text(json.dumps(result))
        print(f"[e2e] {mode}: " + json.dumps({k: v for k, v in result.items() if k != "outputs"}))


def report(args: argparse.Namespace, modes: list[str], work: Path, results: dict[str, Any]) -> None:
    """The report over every engine that finished, in this call or an earlier one."""
    for mode in [*modes, "forced-wrong", *PIECEWISE_MODES]:  # earlier calls' engines
        if mode not in results["engines"] and (work / f"{mode}.json").exists():
            results["engines"][mode] = json.loads((work / f"{mode}.json").read_text())
    outputs = {m: e.pop("outputs") for m, e in results["engines"].items() if "outputs" in e}
    Path(args.out).with_suffix(".outputs.json").write_text(json.dumps(outputs))
    results.update(compare(results["engines"], outputs))
    write_results(args.out, results)
    print(json.dumps({k: v for k, v in results.items() if k != "engines"}, indent=1))


if __name__ == "__main__":
    main()
