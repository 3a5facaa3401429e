"""The README's main job: ``vllm serve`` with dynamic offloading on this CPU machine, driven
by vLLM's own benchmark client (``vllm bench serve``) over HTTP.

An 8-layer Llama config with dummy weights and the synthetic tokenizer
(:mod:`bench.synth_tokenizer`), 4 MiB of KV cache at level 0, and a bursty ShareGPT-length
trace (a lull, a burst that fills the cache, a lull), then a light tail of single
requests, under which the level comes back down. The server is vLLM's OpenAI API server
with the README's plugin flags and ``VLLM_PLUGINS=dynamic_offload`` (the plugin's metrics
and its status endpoint). While the client runs, the job reads the status endpoint; after
it, it prints the benchmark's summary, the levels the server went through, and the plugin's
lines of ``/metrics``.

    python -m bench.main_job            # ~2-3 minutes on 2 cores, once installed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import serve_bench, traces
from bench.cpu_demo import TINY_POLICY

ROOT = Path(__file__).parents[1]
SERVER_ARGS = ["--kv-cache-memory-bytes=4194304", "--max-model-len=2048", "--dtype=bfloat16"]
PLUGIN = {
    "host_page_size": 64 << 10,
    "policy": TINY_POLICY,
}


def get_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return json.loads(reply.read())


def post_json(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def plugin_metrics(port: int) -> list[str]:
    """The plugin's samples on ``/metrics`` (``vllm:dynoff_*``), without comments."""
    lines = serve_bench.metric_samples(port, timeout_s=5)
    return [line for line in lines if line.startswith("vllm:dynoff_") and "_bucket" not in line]


class StatusWatcher(threading.Thread):
    """Reads the status endpoint every ``period_s``: the levels the server went through."""

    def __init__(self, port: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.port, self.period_s = port, period_s
        self.levels: list[int] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                status = get_json(self.port, "/dynamic_offload/status")
            except (OSError, ValueError):
                status = None
            if status is not None and (not self.levels or self.levels[-1] != status["level"]):
                self.levels.append(status["level"])
            self._done.wait(self.period_s)

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=10)


def model_dir(workdir: Path, layers: int) -> Path:
    from bench.synth_tokenizer import write

    model = workdir / "small-llama"
    model.mkdir(parents=True, exist_ok=True)
    config = json.loads((ROOT / "tests/models/tiny-llama/config.json").read_text())
    config["num_hidden_layers"] = layers
    (model / "config.json").write_text(json.dumps(config, indent=2))
    write(model)
    return model


def start_server(
    model: Path, workdir: Path, plugin: dict[str, Any], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = serve_bench.free_port()
    args = argparse.Namespace(
        model=str(model),
        system="plugin",
        gpu_memory_utilization=None,
        server_arg=SERVER_ARGS,
        plugin_config=json.dumps(plugin),
    )
    cmd = serve_bench.server_command(args, port, workdir / "trace.jsonl")
    log = workdir / "server.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    return server, port, log


def server_env(dev_mode: bool = False) -> dict[str, str]:
    """``VLLM_PLUGINS=dynamic_offload`` names the plugin's entry points (general plugin,
    stat logger, endpoint); dev mode adds the endpoint's control route."""
    env = {**os.environ, "VLLM_PLUGINS": "dynamic_offload"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dynoff-main-"))
    model = model_dir(workdir, args.layers)
    requests = workdir / "requests.jsonl"
    phases = traces.phases_bursty(0.5, args.burst_rate, lull_s=3, burst_s=args.burst_s, cycles=1)
    count = traces.write(requests, traces.trace("sharegpt", phases, seed=args.seed))
    started = time.monotonic()
    server, port, log = start_server(model, workdir, PLUGIN, server_env())
    try:
        serve_bench.wait_ready(server, port, log, args.ready_timeout_s)
        print(f"[main job] vllm serve with the plugin is up in {time.monotonic() - started:.0f} s")
        print(f"[main job] vllm bench serve: {count} requests (a lull, a burst, a lull)")
        watcher = StatusWatcher(port)
        watcher.start()
        client = subprocess.run(
            serve_bench.client_command(str(model), str(requests), port, workdir),
            capture_output=True,
            text=True,
        )
        if client.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{client.stderr[-4000:]}")
        print(f"[main job] a light tail: {args.tail} requests, one at a time")
        body = {"model": str(model), "prompt": "t5 t6 t7 t8", "max_tokens": 128}
        for _ in range(args.tail):  # low pressure: the policy steps the level back down
            main_tail = post_json(port, "/v1/completions", {**body, "ignore_eos": True})
            assert main_tail["choices"], main_tail
        time.sleep(1.5)  # the last change reaches the board and the metrics
        watcher.finish()
        metrics = plugin_metrics(port)
        status = get_json(port, "/dynamic_offload/status")
    finally:
        serve_bench.stop(server)
    result = serve_bench.client_result(workdir / "client.json")
    summary = [line for line in client.stdout.splitlines() if line.strip()]
    return {
        "client": result,
        "client_summary": summary,
        "levels": watcher.levels,
        "status": status,
        "metrics": metrics,
        "workdir": str(workdir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--burst-rate", type=float, default=4.0)
    parser.add_argument("--burst-s", type=float, default=5.0)
    parser.add_argument("--tail", type=int, default=6, help="light-tail requests")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    out = run(args)
    start = next(
        (i for i, line in enumerate(out["client_summary"]) if "Serving Benchmark Result" in line), 0
    )
    print("\n".join(out["client_summary"][start:]))
    status = out["status"]
    print("\n== dynamic offload ==")
    print(f"levels the server went through: {' -> '.join(map(str, out['levels']))}")
    print(
        f"level changes: {status['changes']['up']} up, {status['changes']['down']} down; "
        f"failed resizes: {status['resize_failures']}; now at level {status['level']} "
        f"({status['capacity_tokens']} tokens of KV)"
    )
    print("from /metrics:")
    for line in out["metrics"]:
        if "_created" not in line and ("decision" not in line or line.endswith(" 1.0")):
            print(f"  {line}")
    print(f"server log and requests: {out['workdir']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if out["client"]["failed"]:
        raise SystemExit(f"{out['client']['failed']} requests failed")


if __name__ == "__main__":
    main()
