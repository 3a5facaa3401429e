"""The no-harm report: the plugin with its defaults against stock vLLM with its defaults,
point by point (regime, workload, rate), from ``bench.serve_bench`` runs.

    python -m bench.no_harm RUN.json [RUN.json ...] --out bench/results/no_harm_h200.json \\
        [--plots bench/results/plots]

Runs pair up by their ``point``; each point gets the plugin / stock ratios the issue bounds
(throughput >= 0.99; mean and P99 E2E <= 1.02; P99 TTFT <= 1.10; median TPOT <= 1.02) and
says which it misses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import read_results, save_figure, write_results
from bench.serve_bench import disconnected_failures

# ratio name -> (vLLM result key, bound, "min" if the ratio must be at least the bound)
BOUNDS: dict[str, tuple[str, float, str]] = {
    "throughput_ratio": ("request_throughput", 0.99, "min"),
    "e2e_mean_ratio": ("mean_e2el_ms", 1.02, "max"),
    "e2e_p99_ratio": ("p99_e2el_ms", 1.02, "max"),
    "ttft_p99_ratio": ("p99_ttft_ms", 1.10, "max"),
    "tpot_p50_ratio": ("median_tpot_ms", 1.02, "max"),
}


def point_key(point: dict[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


def trace_arg(point: dict[str, Any], flag: str) -> str | None:
    """The value of ``flag`` in the point's trace arguments (``bench.traces``), or None."""
    words = str(point.get("trace", "")).split()
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def rate_of(point: dict[str, Any]) -> float | str | None:
    """The point's offered rate: given, or read from its trace arguments (``--rate R``; a
    bursty trace's ``lull/burst`` rates)."""
    if "rate" in point:
        return point["rate"]
    words = str(point.get("trace", "")).split()
    if words and words[0] == "bursty":
        lull = trace_arg(point, "--lull-rate") or "3.0"
        return f"{lull}/{trace_arg(point, '--burst-rate') or '18.0'}"
    return float(trace_arg(point, "--rate") or "nan") if "--rate" in words else None


def point_order(row: dict[str, Any]) -> tuple[str, str, float, str]:
    """Regime, workload, then the offered rate as a number (a bursty point's lull rate)."""
    rate = row.get("rate")
    try:
        number = float(str(rate).split("/")[0])
    except ValueError:
        number = float("inf")
    return (str(row.get("regime")), str(row.get("workload")), number, str(rate))


def kv_blocks_at_level_0(run: dict[str, Any]) -> int | None:
    """The KV blocks a run's server serves with at level 0: stock's whole cache
    (``server_kv_blocks``), the plugin's level-0 capacity (its trace). None where the run
    did not record it (runs before 2026-12-07)."""
    if run.get("system") == "plugin":
        by_level = run.get("plugin", {}).get("capacity_blocks_by_level") or {}
        blocks = by_level.get("0", by_level.get(0))
        return int(blocks) if blocks is not None else None
    blocks = run.get("server_kv_blocks")
    return int(blocks) if blocks is not None else None


def compare(stock: dict[str, Any], plugin: dict[str, Any]) -> dict[str, Any]:
    """One point's ratios (plugin / stock) and the bounds they miss."""
    row: dict[str, Any] = dict(plugin["point"])
    row["rate"] = rate_of(plugin["point"])
    misses = []
    for name, (key, bound, kind) in BOUNDS.items():
        base = stock["client"][key]
        ratio = plugin["client"][key] / base if base else float("nan")
        row[name] = round(ratio, 4)
        if (kind == "min" and ratio < bound) or (kind == "max" and ratio > bound):
            misses.append(name)
    row["misses"] = misses
    uuids = {run.get("machine", {}).get("gpu_uuid") for run in (stock, plugin)}
    row["same_gpu"] = None if None in uuids else len(uuids) == 1  # None: not recorded
    row["levels_visited"] = plugin.get("plugin", {}).get("levels_visited")
    # Not bounded, but what a level-0 latency ratio may come from: the plugin's own KV at
    # level 0 against stock's (the page tables of its pinned homes come out of it).
    stock_blocks, plugin_blocks = kv_blocks_at_level_0(stock), kv_blocks_at_level_0(plugin)
    if stock_blocks and plugin_blocks is not None:
        row["kv_blocks_level_0"] = {"stock": stock_blocks, "plugin": plugin_blocks}
        row["kv_blocks_ratio"] = round(plugin_blocks / stock_blocks, 4)
    # A server that loaded its graph from vLLM's compile cache profiles less activation, so
    # more KV, than one that compiled it (``bench.serve_bench.server_profile``): a pair whose
    # graphs came different ways gives one side KV the other was not given.
    graphs = {
        system: (run.get("server_profile") or {}).get("graph")
        for system, run in (("stock", stock), ("plugin", plugin))
    }
    if all(graphs.values()):
        row["graphs"] = graphs
        row["same_graph_source"] = graphs["stock"] == graphs["plugin"]
    for system, run in (("stock", stock), ("plugin", plugin)):  # did the point bind KV?
        peak = run.get("server_metrics", {}).get("peak")
        if peak:
            row[f"{system}_peak"] = {k: round(v, 3) for k, v in peak.items()}
    return row


def report(paths: list[str]) -> dict[str, Any]:
    runs = [read_results(p) for p in paths]
    by_point: dict[str, dict[str, dict[str, Any]]] = {}
    for run, path in zip(runs, paths, strict=True):
        run["file"] = str(path)
        by_point.setdefault(point_key(run["point"]), {})[run["system"]] = run
    points, unpaired = [], []
    for key, systems in sorted(by_point.items()):
        if {"stock", "plugin"} <= set(systems):
            points.append(compare(systems["stock"], systems["plugin"]))
        else:
            unpaired.append(json.loads(key))
    points.sort(key=point_order)
    failed: dict[str, int] = {}
    disconnected: dict[str, int] = {}  # of those, closed before any response (serve_bench)
    for run in runs:
        system, client = run["system"], run["client"]
        failed[system] = failed.get(system, 0) + int(client["failed"])
        disconnected[system] = disconnected.get(system, 0) + disconnected_failures(client)
    visited = sorted({k for r in runs for k in r.get("plugin", {}).get("levels_visited", [])})
    return {
        "bounds": {name: {"bound": b, "kind": kind} for name, (_, b, kind) in BOUNDS.items()},
        "points": points,
        "unpaired": unpaired,
        "failed_requests": failed,
        "failed_disconnected": disconnected,
        "levels_visited": visited,
        "runs": [
            {
                "file": r["file"],
                "system": r["system"],
                "point": r["point"],
                "command": r["command"],
                "gpu": r.get("machine", {}).get("gpu"),
            }
            for r in runs
        ],
    }


def plot(result: dict[str, Any], out_dir: Path, stem: str = "no_harm") -> Path:
    """One bar group per point: each ratio against its bound (``out_dir/stem.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    names = list(BOUNDS)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(points)), 4))
    width = 0.8 / len(names)
    values = [pt[name] for pt in points for name in names]
    for i, name in enumerate(names):
        xs = [p + i * width for p in range(len(points))]
        ax.bar(xs, [pt[name] for pt in points], width, label=name.removesuffix("_ratio"))
        bound = BOUNDS[name][1]
        ax.hlines(
            [bound] * len(xs),
            [x - width / 2 for x in xs],
            [x + width / 2 for x in xs],
            colors="k",
            lw=2,
        )
    labels = [f"{pt.get('regime')} / {pt.get('workload')}\n{pt.get('rate')} req/s" for pt in points]
    ax.set_xticks([p + 0.4 - width / 2 for p in range(len(points))], labels, fontsize=8)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    low = min(0.9, min(values) - 0.02)
    high = max(1.15, max(values) + 0.02)
    ax.set_ylim(low, high)
    ax.set_ylabel("plugin / stock")
    gpus = sorted({str(run.get("gpu")) for run in result.get("runs", []) if run.get("gpu")})
    title = "No harm under vllm serve (black: the bound each ratio must keep)"
    ax.set_title(title + (f"\n{', '.join(gpus)}" if gpus else ""), fontsize=10)
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plots", default=None)
    args = parser.parse_args()
    result = report(args.runs)
    write_results(args.out, result)
    if args.plots and result["points"]:
        plot(result, Path(args.plots), Path(args.out).name.split(".")[0])
    for point in result["points"]:
        print(json.dumps(point))
    print(json.dumps({"failed_requests": result["failed_requests"]}))


if __name__ == "__main__":
    main()
