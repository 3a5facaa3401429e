"""The CPU KV tier issue's report: the seed's prefix-heavy doc-QA workload on four systems
under ``vllm serve`` (stock, stock with vLLM's CPU KV offloading, the plugin, the plugin with
it), rate sweeps with repetitions, to ``bench/results/prefix_h200.json`` and a plot.

    python -m bench.prefix bench/results/prefix/*.json.gz --out bench/results/prefix_h200.json \\
        --plots bench/results/plots

Each input is one ``bench.serve_bench`` point (``bench/gpu/no_harm.sh`` writes them; the
CPU tier's runs with ``SERVER_ARGS='--kv-offloading-size N'``). A run's system is its
``system`` (stock | plugin), with ``_kvoff`` where its server had ``--kv-offloading-size``;
its rate comes from the trace arguments; points of one system at one rate are repetitions
(traces of different ``--seed``). Per system:

* per rate: the repetitions' request throughput (mean and coefficient of variation), P99
  TTFT, failed requests, and the prefix-cache hit rates from vLLM's own counters (in
  tokens): ``hit_rate_gpu`` (``vllm:prefix_cache_hits / queries``) and ``hit_rate_cpu``
  (``vllm:external_prefix_cache_hits / queries``, the connector's tier);
* ``max_sustainable_rps``: the highest rate every repetition sustained (no failed request
  and P99 TTFT within ``--ttft-bound-ms``), below the first one that was not;
* ``cv``: the mean over rates of the throughput's coefficient of variation;
* ``cv_served``: the same for each repetition's throughput over its own trace's offered
  rate (``served_fraction``), which takes out the traces' own spread across seeds.

And the issue's goals: the plugin with the CPU tier at least stock with it at every rate
(throughput), with a CV no larger, and its max sustainable rate against twice stock's.
``pairs`` holds, for every trace that both the plugin and stock ran (with the tier, and
without it), the no-harm issue's ratios (plugin / stock, ``bench.no_harm.BOUNDS``) and the
bounds they miss, with each side's KV at level 0, whether both ran on one GPU
(``same_gpu``) and got their graphs the same way (``same_graph_source``);
``goals.within_no_harm_bounds`` says whether every pair kept the bounds.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.common import read_results, save_figure, write_results
from bench.no_harm import BOUNDS, compare, rate_of, trace_arg

TTFT_BOUND_MS = 1000.0


def system_of(run: dict[str, Any]) -> str:
    command = " ".join(map(str, run.get("server_command") or []))
    return str(run["system"]) + ("_kvoff" if "--kv-offloading-size" in command else "")


def _ratio(hits: float | None, queries: float | None) -> float | None:
    return round(hits / queries, 4) if hits is not None and queries else None


def served_fraction(run: dict[str, Any]) -> float | None:
    """Completed requests per second over the trace's own offered rate (its requests over
    its ``--seconds``), or None where the run does not say: repetitions are traces of other
    seeds, whose Poisson arrivals differ (116 and 149 requests at 3 req/s over 45 s), so the
    throughput's spread across them is mostly the traces'; this fraction's is the server's."""
    seconds = trace_arg(run.get("point") or {}, "--seconds")
    prompts = run["client"].get("num_prompts")
    if not seconds or not prompts:
        return None
    return float(run["client"]["request_throughput"]) / (float(prompts) / float(seconds))


def _cv(values: list[float]) -> float | None:
    mean = statistics.fmean(values) if values else 0.0
    return round(statistics.pstdev(values) / mean, 4) if mean and len(values) > 1 else None


def repetition(run: dict[str, Any], ttft_bound_ms: float) -> dict[str, Any]:
    """One repetition's figures."""
    client = run["client"]
    peak = (run.get("server_metrics") or {}).get("peak") or {}
    return {
        "throughput": float(client["request_throughput"]),
        "served_fraction": served_fraction(run),
        "p99_ttft_ms": float(client["p99_ttft_ms"]),
        "failed": int(client["failed"]),
        "sustained": int(client["failed"]) == 0 and client["p99_ttft_ms"] <= ttft_bound_ms,
        "hit_rate_gpu": _ratio(peak.get("prefix_hits"), peak.get("prefix_queries")),
        "hit_rate_cpu": _ratio(
            peak.get("external_prefix_hits"), peak.get("external_prefix_queries")
        ),
        "levels_visited": (run.get("plugin") or {}).get("levels_visited"),
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 4) if present else None


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate of one system over its repetitions."""
    tputs = [r["throughput"] for r in reps]
    served = [r["served_fraction"] for r in reps]
    complete = all(f is not None for f in served)
    return {
        "repetitions": len(reps),
        "throughput": round(statistics.fmean(tputs), 4),
        "cv": _cv(tputs),
        "served_fraction": _mean(served) if complete else None,
        "cv_served": _cv([f for f in served if f is not None]) if complete else None,
        "p99_ttft_ms": round(max(r["p99_ttft_ms"] for r in reps), 2),
        "failed": sum(r["failed"] for r in reps),
        "sustained": all(r["sustained"] for r in reps),
        "hit_rate_gpu": _mean([r["hit_rate_gpu"] for r in reps]),
        "hit_rate_cpu": _mean([r["hit_rate_cpu"] for r in reps]),
    }


def max_sustainable(rates: dict[float, dict[str, Any]]) -> float | None:
    best = None
    for rate in sorted(rates):
        if not rates[rate]["sustained"]:
            break
        best = rate
    return best


def report(paths: list[str], ttft_bound_ms: float = TTFT_BOUND_MS) -> dict[str, Any]:
    by_system: dict[str, dict[float, list[dict[str, Any]]]] = {}
    commands = []
    seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}  # (system, trace) -> file, run
    for path in paths:
        run = read_results(path)
        rate = rate_of(run.get("point") or {})
        if not isinstance(rate, float | int):
            raise ValueError(f"{path}: no single rate in its point {run.get('point')}")
        system = system_of(run)
        trace = str((run.get("point") or {}).get("trace"))
        if (system, trace) in seen:  # one trace twice is not two repetitions
            raise ValueError(
                f"{path} and {seen[system, trace][0]}: {system} ran the same trace ({trace}) "
                "twice; a repetition needs another --seed: pass one of the two"
            )
        seen[system, trace] = (str(path), run)
        by_system.setdefault(system, {}).setdefault(float(rate), []).append(
            repetition(run, ttft_bound_ms)
        )
        commands.append({"file": str(path), "system": system, "command": run.get("command")})
    systems: dict[str, Any] = {}
    for system, rates in sorted(by_system.items()):
        summary = {rate: summarize(reps) for rate, reps in sorted(rates.items())}
        systems[system] = {
            "max_sustainable_rps": max_sustainable(summary),
            "cv": _mean([s["cv"] for s in summary.values()]),
            "cv_served": _mean([s["cv_served"] for s in summary.values()]),
            "hit_rate_gpu": _mean([s["hit_rate_gpu"] for s in summary.values()]),
            "hit_rate_cpu": _mean([s["hit_rate_cpu"] for s in summary.values()]),
            "rates": {str(rate): s for rate, s in summary.items()},
        }
    pairs = paired({key: run for key, (_, run) in seen.items()})
    out_goals = goals(systems)
    out_goals["within_no_harm_bounds"] = all(not row["misses"] for row in pairs) if pairs else None
    return {
        "ttft_bound_ms": ttft_bound_ms,
        "systems": systems,
        "goals": out_goals,
        "pairs": pairs,
        "runs": commands,
    }


def paired(runs: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The plugin against stock on each trace both ran, with the tier and without it."""
    rows: list[dict[str, Any]] = []
    # Unbounded, where the runs recorded them: each side's KV at level 0, and whether the
    # two ran on one GPU and got their graphs the same way (a loaded graph is given more KV).
    unbounded = ("kv_blocks_level_0", "kv_blocks_ratio", "graphs", "same_graph_source")
    for ours, theirs in (("plugin_kvoff", "stock_kvoff"), ("plugin", "stock")):
        traces = sorted(
            {t for s, t in runs if s == ours} & {t for s, t in runs if s == theirs},
            key=lambda t: (rate_of({"trace": t}) or 0.0, t),
        )
        for trace in traces:
            row = compare(runs[theirs, trace], runs[ours, trace])
            rows.append(
                {
                    "systems": f"{ours} / {theirs}",
                    "trace": trace,
                    "rate": row["rate"],
                    **{name: row[name] for name in BOUNDS},
                    "misses": row["misses"],
                    "levels_visited": row["levels_visited"],
                    "same_gpu": row["same_gpu"],
                    **{key: row[key] for key in unbounded if key in row},
                }
            )
    return rows


def goals(systems: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, where the runs allow them to be read (None: a system is missing)."""
    ours, theirs, stock = (systems.get(s) for s in ("plugin_kvoff", "stock_kvoff", "stock"))
    out: dict[str, Any] = {
        "no_harm_every_rate": None,
        "cv_no_larger": None,
        "cv_served_no_larger": None,
        "twice_stock": None,
    }
    if ours and theirs:
        shared = set(ours["rates"]) & set(theirs["rates"])
        out["no_harm_every_rate"] = bool(shared) and all(
            ours["rates"][r]["throughput"] >= theirs["rates"][r]["throughput"] for r in shared
        )
        if ours["cv"] is not None and theirs["cv"] is not None:
            out["cv_no_larger"] = ours["cv"] <= theirs["cv"]
        if ours["cv_served"] is not None and theirs["cv_served"] is not None:
            out["cv_served_no_larger"] = ours["cv_served"] <= theirs["cv_served"]
    if ours and stock and ours["max_sustainable_rps"] and stock["max_sustainable_rps"]:
        ratio = ours["max_sustainable_rps"] / stock["max_sustainable_rps"]
        out["over_stock"] = round(ratio, 4)
        out["twice_stock"] = ratio >= 2.0
    return out


def plot(result: dict[str, Any], out_dir: Path, stem: str = "prefix") -> Path:
    """Throughput and P99 TTFT against the offered rate, one line per system, the spread
    of the repetitions as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for system, data in result["systems"].items():
        rates = sorted(data["rates"], key=float)
        xs = [float(r) for r in rates]
        tput = [data["rates"][r]["throughput"] for r in rates]
        spread = [(data["rates"][r]["cv"] or 0.0) * t for r, t in zip(rates, tput, strict=True)]
        # colour: with or without the CPU tier; line and marker: stock or the plugin, so a
        # plugin that matches stock shows as a dashed line over a solid one, not as nothing
        plugin = system.startswith("plugin")
        style = {
            "color": "tab:red" if system.endswith("_kvoff") else "tab:blue",
            "linestyle": "--" if plugin else "-",
            "marker": "x" if plugin else "o",
            "markersize": 8 if plugin else 6,
        }
        left.errorbar(xs, tput, yerr=spread, capsize=3, label=system, **style)
        right.plot(xs, [data["rates"][r]["p99_ttft_ms"] / 1e3 for r in rates], **style)
    left.set(xlabel="offered rate (req/s)", ylabel="completed (req/s)", title="throughput")
    left.set_ylim(bottom=0)  # a 0.5% gap must not fill the axis
    right.axhline(result["ttft_bound_ms"] / 1e3, color="gray", linestyle=":")
    right.set(xlabel="offered rate (req/s)", ylabel="P99 TTFT (s)", title="worst repetition")
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.suptitle("doc QA (16 documents of ~4k tokens) under vllm serve")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"  # named after the report: prefix_h200.png, prefix_h100.png
    save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="bench.serve_bench results (.json or .json.gz)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ttft-bound-ms", type=float, default=TTFT_BOUND_MS)
    parser.add_argument("--plots", default=None, help="folder for the plot, named after --out")
    args = parser.parse_args()
    result = report(args.runs, args.ttft_bound_ms)
    write_results(args.out, result)
    if args.plots:
        print(f"wrote {plot(result, Path(args.plots), Path(args.out).name.split('.')[0])}")
    for system, data in result["systems"].items():
        print(
            f"{system}: max sustainable {data['max_sustainable_rps']} req/s, cv {data['cv']} "
            f"(served {data['cv_served']}), "
            f"hit rate GPU {data['hit_rate_gpu']} CPU {data['hit_rate_cpu']}"
        )
    for row in result["pairs"]:
        ratios = ", ".join(f"{name.removesuffix('_ratio')} {row[name]}" for name in BOUNDS)
        misses = f"; misses {', '.join(row['misses'])}" if row["misses"] else ""
        apart = "; on two GPUs" if row["same_gpu"] is False else ""
        print(f"{row['systems']} at {row['trace']}: {ratios}{misses}{apart}")
    print(f"goals: {result['goals']}")


if __name__ == "__main__":
    main()
