"""Per-level microbenchmark inside a real vLLM engine with the plugin (dummy weights).

    python -m bench.microbench --model /tmp/site/models/qwen3-32b --levels 0 1 2 4 8 16 \\
        --out $OUT/microbench_qwen3-32b_h200.json [--profile-level 4]

One engine, its level steered from outside through the plugin's ``level_file``; per level:

* **transfer**: achieved H2D GB/s of the prefetch copies (CUDA events around each copy),
  against the link peak measured in the same engine (``h2d_peak_GBps``);
* **iteration time** (CUDA events around each forward, from the plugin's trace), split into
  decode-only steps at batch ``--decode-batch``, prefill-only steps (``--prefill-prompts``
  prompts of ``--prompt-len`` tokens; timed on full chunks of ``prefill_tokens``) and
  mixed steps (that decode batch plus chunks of ``--mixed-prompts`` such prompts), and the
  KV capacity (GiB, tokens) the scheduler sees at that level;
* **resize cost** of every transition k -> k+1 on the way up and k+1 -> k on the way down:
  wall time, page slots remapped, and its parts: waiting for queued GPU work, VMM driver
  calls, restoring layers from pinned memory;
* ``decode_ms_predicted``: the policy's latency model (:class:`OffloadCostModel`),
  calibrated only from level 0's decode step, the link peak and the piecewise penalty
  (level 0 forced onto the piecewise path, reported as level ``"0p"``).

``--profile-level K`` also records a ``torch.profiler`` trace of a few decode iterations at
level K (Chrome trace, gzip) showing the copy stream next to compute. Runs on the CPU engine
too (``--cpu``, a generated Llama; transfers are then synchronous copies and not timed).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import model_or_generated, write_results

CAPTURE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
WORKER = "dynoff.compile_pass.worker.DynamicOffloadWorker"
SCHEDULER = "dynoff.policy.scheduler.DynamicOffloadScheduler"


def read_trace(path: Path, start: int = 0) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()[start:]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return records


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.level_file = workdir / "level"
        self.trace = workdir / "trace.jsonl"
        self.level_file.write_text("0")
        self.rng = random.Random(0)
        self.llm = self._engine()
        vllm_config = self.llm.llm_engine.vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.geometry = self.llm.collective_rpc("dynoff_stats")[0]

    # -- engine ---------------------------------------------------------------------------------
    def _engine(self) -> Any:
        from vllm import LLM

        args = self.args
        offload: dict[str, Any] = {
            "trace_path": str(self.trace),
            "level_file": str(self.level_file),
            "measure_transfers": True,
            "policy": {"max_level": max(args.levels)},
        }
        if args.cpu:
            from bench.cpu_demo import engine_kwargs

            offload["host_page_size"] = 64 << 10
            kwargs = engine_kwargs(args.model, offload, kv_bytes=args.kv_bytes)
        else:
            from dynoff.compile_pass.config import dynoff_compilation_config

            kwargs = dict(
                model=args.model,
                load_format="dummy",
                skip_tokenizer_init=True,
                max_model_len=args.prompt_len + 512,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=256,
                seed=0,
                disable_log_stats=True,
                quantization=args.quantization,
                worker_cls=WORKER,
                scheduler_cls=SCHEDULER,
                compilation_config=dynoff_compilation_config(
                    {"cudagraph_capture_sizes": CAPTURE}, route=args.route
                ),
                additional_config={"dynamic_offload": offload},
            )
        if args.profile_level is not None:
            kwargs["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": str(self.workdir / "profile"),
                "torch_profiler_with_stack": False,
            }
        return LLM(**kwargs)

    def generate(self, batch: list[tuple[int, int]]) -> None:
        """``batch``: (prompt length, output length) pairs, fresh random prompts each time
        (no prefix-cache hits)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [
            TokensPrompt(prompt_token_ids=[self.rng.randrange(3, self.vocab) for _ in range(n)])
            for n, _ in batch
        ]
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, detokenize=False)
            for _, m in batch
        ]
        self.llm.generate(prompts, params, use_tqdm=False)

    # -- levels ---------------------------------------------------------------------------------
    def current_level(self) -> int:
        changes = [r for r in read_trace(self.trace) if r.get("event") == "level_change"]
        return changes[-1]["to_level"] if changes else 0

    def set_level(self, level: int, timeout_s: float = 600.0) -> None:
        """Steer the scheduler to ``level`` and drive short requests until it is there (the
        scheduler moves one level per step it schedules)."""
        self.level_file.write_text(str(level))
        deadline = time.monotonic() + timeout_s
        while self.current_level() != level:
            if time.monotonic() > deadline:
                raise TimeoutError(f"level {level} not reached; at {self.current_level()}")
            self.generate([(16, 4)] * 4)

    # -- one level ------------------------------------------------------------------------------
    def measure(self, level: int | str) -> dict[str, Any]:
        args = self.args
        self.llm.collective_rpc("dynoff_stats")  # resets the transfer counters
        mark = len(read_trace(self.trace))
        self.generate([(args.prompt_len, 1)] * args.prefill_prompts)  # prefill-only steps
        # Prefill is timed on these steps only: full chunks of long prompts. (The mixed
        # phase starts with a step of short prompts, a different composition.) A step's
        # forward time is reported with a later step, so the phase is told by step number.
        last_prefill_step = max(
            (r["step"] for r in read_trace(self.trace, mark) if r["kind"] == "step"), default=0
        )
        mixed = [(128, args.decode_tokens)] * args.decode_batch
        mixed += [(args.prompt_len, 1)] * args.mixed_prompts  # chunks join the decodes
        self.generate(mixed)
        records = read_trace(self.trace, mark)
        transfers = self.llm.collective_rpc("dynoff_stats")[0]["transfers"]
        forwards = [r for r in records if r["kind"] == "forward"]
        decode = [
            r["forward_ms"]
            for r in forwards
            if r["prefill_tokens"] == 0 and r["decode_tokens"] == args.decode_batch
        ]
        chunks = [
            r
            for r in forwards
            if r["step"] <= last_prefill_step and r["decode_tokens"] == 0 and r["prefill_tokens"]
        ]
        chunk = max((r["prefill_tokens"] for r in chunks), default=0)
        prefill = [r["forward_ms"] for r in chunks if r["prefill_tokens"] == chunk]
        mixed_ms = [
            r["forward_ms"]
            for r in forwards
            if r["decode_tokens"] >= args.decode_batch // 2 and r["prefill_tokens"] > 0
        ]
        steps = [r for r in records if r["kind"] == "step"]
        blocks = max((r["capacity_blocks"] for r in steps), default=0)
        seconds = transfers["seconds"]
        return {
            "level": level,
            "offloaded_layers": 2 * level if isinstance(level, int) else 0,
            "h2d_GBps": round(transfers["bytes"] / seconds / 1e9, 2) if seconds else None,
            "h2d_copies": transfers["copies"],
            "decode_ms": _median(decode),
            "prefill_ms": _median(prefill),
            "prefill_tokens": chunk,
            "mixed_ms": _median(mixed_ms),
            "samples": {"decode": len(decode), "prefill": len(prefill), "mixed": len(mixed_ms)},
            "kv_capacity_blocks": blocks,
            "kv_capacity_tokens": blocks * self.block_size,
            "kv_capacity_gib": round(blocks * self.geometry["kv_block_bytes"] / 2**30, 3),
        }

    def profile(self, level: int) -> Path | None:
        """A torch.profiler trace of a few decode iterations at ``level``."""
        self.set_level(level)
        self.llm.start_profile()
        self.generate([(128, 8)] * 16)
        self.llm.stop_profile()
        traces = sorted((self.workdir / "profile").rglob("*.json.gz"))
        return traces[-1] if traces else None


def copy_overlap(trace_path: Path, min_us: float = 1000.0) -> dict[str, Any]:
    """From a ``torch.profiler`` Chrome trace: the prefetch copies (H2D memcpys longer than
    ``min_us``), the streams they and the kernels ran on, and the share of copy time during
    which a kernel ran on another stream."""
    import gzip

    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    copies = [
        e
        for e in events
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and e["dur"] > min_us
    ]
    kernel_events = [e for e in events if e.get("cat") == "kernel"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernel_events)
    copy_us = overlap_us = 0.0
    for copy in copies:
        start, end = copy["ts"], copy["ts"] + copy["dur"]
        copy_us += end - start
        cursor = start
        for k_start, k_end in kernels:  # sorted: sweep the kernels that meet the copy
            if k_start >= end:
                break
            lo, hi = max(k_start, cursor), min(k_end, end)
            if hi > lo:
                overlap_us += hi - lo
                cursor = hi
    return {
        "copies": len(copies),
        "copy_streams": sorted({c["args"].get("stream") for c in copies}),
        "kernel_streams": sorted({k["args"].get("stream") for k in kernel_events}),
        "copy_ms": round(copy_us / 1e3, 2),
        "copy_ms_with_kernels_running": round(overlap_us / 1e3, 2),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def resize_costs(trace: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every level change in the trace, keyed ``"k->k'"`` (the last one of each)."""
    costs = {}
    for r in trace:
        if r.get("event") == "level_change":
            costs[f"{r['from_level']}->{r['to_level']}"] = {
                key: r.get(key)
                for key in ("remap_ms", "sync_ms", "driver_ms", "copy_ms", "slots_changed")
            }
    return costs


def predict(levels: dict[str, dict[str, Any]], geometry: dict[str, Any], peak: float) -> None:
    """Fill ``decode_ms_predicted`` from level 0, the link peak and the piecewise penalty."""
    from dynoff.policy.latency import OffloadCostModel, StepCost, StepShape

    k0, k0p = levels.get("0", {}).get("decode_ms"), levels.get("0p", {}).get("decode_ms")
    if not k0 or not peak:
        return
    model = OffloadCostModel.from_step_cost(
        geometry["num_layers"],
        geometry["layer_bytes"],
        peak * 1e9,
        StepCost(k0),
        piecewise_penalty_ms=max(0.0, (k0p or k0) - k0),
    )
    for key, entry in levels.items():
        if key == "0p" or entry.get("decode_ms") is None:
            continue
        shape = StepShape(num_decode_tokens=entry.get("decode_batch", 1))
        predicted = model.step_ms(int(key), shape)
        entry["decode_ms_predicted"] = round(predicted, 3)
        entry["prediction_error"] = round(
            abs(predicted - entry["decode_ms"]) / entry["decode_ms"], 4
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dynoff-microbench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("trace.jsonl", "level"):
        (workdir / stale).unlink(missing_ok=True)
    start = time.monotonic()
    bench = Bench(args, workdir)
    startup_s = time.monotonic() - start
    peak = 0.0 if args.cpu else float(bench.llm.collective_rpc("dynoff_link_peak")[0])
    bench.generate([(128, 8)] * 8)  # warm-up
    levels: dict[str, dict[str, Any]] = {}
    plan = [0, "0p", *[k for k in sorted(set(args.levels)) if k > 0]]
    for level in tqdm(plan, desc="levels", unit="level"):
        if level == "0p":
            bench.llm.collective_rpc("dynoff_force_piecewise", args=(True,))
            entry = bench.measure("0p")
            bench.llm.collective_rpc("dynoff_force_piecewise", args=(False,))
        else:
            assert isinstance(level, int)
            bench.set_level(level)
            entry = bench.measure(level)
        entry["decode_batch"] = args.decode_batch
        entry["h2d_peak_GBps"] = round(peak, 2)
        levels[str(level)] = entry
        tqdm.write(json.dumps(entry))
        # a crash or a timeout later in the sweep keeps what is measured so far
        write_results(args.out, {"model": args.model, "partial": True, "levels": levels})
    profile = None
    if args.profile_level is not None:
        profile = bench.profile(args.profile_level)
    bench.set_level(0)  # every k+1 -> k on the way down
    costs = resize_costs(read_trace(bench.trace))
    for key, entry in levels.items():
        if key == "0p":
            continue
        k = int(key)
        up, down = costs.get(f"{k}->{k + 1}"), costs.get(f"{k + 1}->{k}")
        entry["resize_up_ms"] = up and up["remap_ms"]
        entry["resize_down_ms"] = down and down["remap_ms"]
        entry["pages_remapped"] = up and up["slots_changed"]
    predict(levels, bench.geometry, peak)
    results: dict[str, Any] = {
        "model": args.model,
        "quantization": args.quantization,
        "route": args.route,
        "startup_s": round(startup_s, 1),
        "geometry": bench.geometry,
        "block_size": bench.block_size,
        "workload": {
            "decode_batch": args.decode_batch,
            "decode_tokens": args.decode_tokens,
            "prefill_prompts": args.prefill_prompts,
            "mixed_prompts": args.mixed_prompts,
            "prompt_len": args.prompt_len,
        },
        "levels": levels,
        "resize": costs,
        "summary": summarize(levels, costs),
    }
    if profile is not None:
        target = Path(args.out).with_name(Path(args.out).stem + "_profile.json.gz")
        shutil.copy(profile, target)
        results["profile_trace"] = target.name
        results["profile_overlap"] = copy_overlap(target)
    return results


def summarize(levels: dict[str, dict[str, Any]], costs: dict[str, dict[str, Any]]) -> dict:
    measured = {int(k): v for k, v in levels.items() if k != "0p" and v["decode_ms"] is not None}
    top = max(measured)
    summary: dict[str, Any] = {"highest_level": top}
    if measured[top].get("h2d_GBps") and measured[top].get("h2d_peak_GBps"):
        summary["h2d_over_peak_at_highest"] = round(
            measured[top]["h2d_GBps"] / measured[top]["h2d_peak_GBps"], 3
        )
    offloaded = [k for k in measured if k > 0]
    if len(offloaded) >= 2:  # least-squares slope of decode time over offloaded layers
        xs = [2 * k for k in offloaded]
        ys = [measured[k]["decode_ms"] for k in offloaded]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        summary["decode_ms_per_offloaded_layer"] = round(slope, 3)
    ups = [c["remap_ms"] for key, c in costs.items() if _up(key)]
    downs = [c["remap_ms"] for key, c in costs.items() if not _up(key)]
    if ups:
        summary["resize_up_ms_median"] = round(statistics.median(ups), 2)
        summary["resize_down_ms_median"] = round(statistics.median(downs), 2) if downs else None
        summary["resize_driver_ms_median"] = round(
            statistics.median(c["driver_ms"] for key, c in costs.items() if _up(key)), 2
        )
    errors = [v["prediction_error"] for v in measured.values() if "prediction_error" in v]
    if errors:
        summary["latency_model_worst_error"] = max(errors)
    return summary


def _up(key: str) -> bool:
    a, b = key.split("->")
    return int(b) > int(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default with --cpu: generated)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--quantization",
        default=None,
        help="the checkpoint's quantization: the plugin refuses quantized checkpoints at "
        "start-up until one has been tested",
    )
    parser.add_argument("--route", choices=["partition", "split"], default="split")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--mixed-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--profile-level", type=int, default=None)
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU engine, generated model")
    parser.add_argument("--kv-bytes", type=int, default=16 << 20, help="CPU KV cache bytes")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    model_or_generated(parser, args)
    results = run(args)
    write_results(args.out, results)
    print(json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
    main()
