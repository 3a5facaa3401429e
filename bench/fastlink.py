"""The fast-link issue's report: serving on an emulated GH200-class link (a device home paced
to ``home_GBps``) against stock vLLM, the best static level and stock at 0.9, under ``vllm
serve``, to ``bench/results/fastlink_h200.json`` and plots.

    python -m bench.fastlink bench/results/fastlink/*.json.gz \\
        [--interference bench/results/fastlink/interference_h200.json] \\
        --out bench/results/fastlink_h200.json --plots bench/results/plots

Each input is one ``bench.serve_bench`` point (``bench/gpu/no_harm.sh`` writes them). A run's
system is read from its server's command, not from a label:

* ``stock``: stock vLLM at the plugin runs' ``--gpu-memory-utilization``; ``stock_0.9`` (say)
  at another, the ceiling of what more KV buys on the GPU;
* ``dynamic@LINK``: the plugin with its policy; ``static_kK@LINK``: the plugin held at level
  K (a ``level_schedule`` of one level);
* ``LINK``: ``host`` for the pinned host home (the real link: PCIe here, NVLink-C2C on a
  GH200), ``390GBps`` (say) for a device home paced to that bandwidth: **an emulation** of
  a fast link on one GPU, labelled so in every figure (``emulation: true``).

Per workload and system, over its rates: each rate's client figures and whether it was
sustained (no failed request, the server's waiting queue did not grow over the trace's
arrivals: ``bench.serving``'s rule, its slope below 2% of the offered rate; and P99 TTFT
within ``--ttft-bound-ms``, the simulator's bound for its rates), ``max_sustainable_rps``
(the highest achieved rate among the sustained ones) and ``knee`` (how the sweep passed its
knee, or None: a lower bound only). For the plugin: ``link_GBps_target``, the calibration's
``link_GBps_achieved`` (on an idle GPU, at start-up), ``link_GBps_achieved_serving`` (the
pacer's reports while serving, beside the steps' kernels; the lowest run's median) and
``levels_visited``. Per workload and link, the ratios
``dynamic_over_stock`` and ``dynamic_over_best_static``, and ``ceiling_over_stock``; and
``at_same_rate``, the dynamic system's achieved rate and latencies over stock's at each offered
rate both ran (a lone overloaded point has no sustainable rate on either side).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import read_results, save_figure, write_results
from bench.no_harm import rate_of, trace_arg
from bench.serving import max_sustainable_rate, queue_slope, sustainable
from bench.serving_report import knee

EMULATION_NOTE = (
    "EMULATION: the 'device' home keeps offloaded layers in HBM outside vLLM's budget and "
    "paces device-to-device copies to home_GBps; a real fast link moves bytes with a DMA "
    "engine over NVLink-C2C. See 'interference' for what the emulation costs by itself."
)
TTFT_BOUND_MS = 1000.0  # bench.simulator's --ttft-bound-ms, for its predicted rates
CLIENT_KEYS = ("request_throughput", "mean_e2el_ms", "p99_e2el_ms", "p99_ttft_ms", "median_tpot_ms")


def _flag(command: list[str], name: str) -> str | None:
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def plugin_config(run: dict[str, Any]) -> dict[str, Any] | None:
    """The plugin's configuration as its server got it (None: a stock server)."""
    raw = _flag(list(map(str, run.get("server_command") or [])), "--additional-config")
    if run.get("system") != "plugin" or raw is None:
        return None
    return dict(json.loads(raw).get("dynamic_offload") or {})


def utilization(run: dict[str, Any]) -> float | None:
    value = _flag(list(map(str, run.get("server_command") or [])), "--gpu-memory-utilization")
    return None if value is None else float(value)


def link_of(config: dict[str, Any]) -> tuple[str, float | None]:
    """``(name, target GB/s)`` of the plugin's copy source."""
    if config.get("home") == "device":
        target = config.get("home_GBps")
        return (f"{float(target):g}GBps" if target else "device_unpaced"), target
    return "host", None


def system_of(run: dict[str, Any], plugin_util: float | None) -> str:
    config = plugin_config(run)
    if config is None:
        util = utilization(run)
        return "stock" if util is None or util == plugin_util else f"stock_{util:g}"
    link, _ = link_of(config)
    levels = {int(level) for _, level in config.get("level_schedule") or []}
    if len(levels) == 1:
        return f"static_k{levels.pop()}@{link}"
    return f"dynamic@{link}"


def traffic_start(client: dict[str, Any], samples: list[dict[str, float]]) -> float:
    """When the trace's first request reached the server, on the samples' clock: the
    client's first send (``serve_bench`` records it), else the first sample with a request
    running or waiting. The sampler starts with the client process, and ``vllm bench
    serve`` takes its time to start: on the H100 (2026-12-06) the first request came 35 s
    after the first sample, and a window from 0 read the queue while the server idled."""
    if client.get("traffic_start_s") is not None:
        return float(client["traffic_start_s"])
    busy = (s["t"] for s in samples if s.get("running", 0.0) or s.get("waiting", 0.0))
    return float(next(busy, 0.0))


def rate_row(run: dict[str, Any], ttft_bound_ms: float = TTFT_BOUND_MS) -> dict[str, Any]:
    """One rate of one system: the client's figures and whether it was sustained: no failed
    request, the server's waiting queue did not grow over the trace's arrivals, and P99 TTFT
    within ``ttft_bound_ms`` (the simulator's rule for its predicted rates). A long-output
    trace of 60 s fills the KV only late in its window, so its queue alone can stay flat at
    four times the rate the server sustains (the H100's stock run, 2026-12-06)."""
    point, client = run.get("point") or {}, run["client"]
    rate = rate_of(point)
    samples = (run.get("server_metrics") or {}).get("samples") or []
    seconds = trace_arg(point, "--seconds")  # the trace's arrival window, where given
    start = traffic_start(client, samples)
    end = start + float(seconds) if seconds else max((s["t"] for s in samples), default=0.0)
    slope = queue_slope([(s["t"], s.get("waiting", 0.0)) for s in samples], start, end)
    failed = int(client.get("failed", 0))
    p99_ttft = client.get("p99_ttft_ms")
    row: dict[str, Any] = {
        "target_rate": rate,
        "achieved_rate": round(float(client["request_throughput"]), 3),
        "queue_slope": round(slope, 4),
        "queue_window_s": [round(start, 2), round(end, 2)],
        "failed": failed,
        "sustainable": failed == 0
        and isinstance(rate, float | int)
        and sustainable(slope, rate)
        and p99_ttft is not None
        and float(p99_ttft) <= ttft_bound_ms,
    }
    row.update({key: client.get(key) for key in CLIENT_KEYS})
    plugin = run.get("plugin") or {}
    if plugin:
        row["levels_visited"] = sorted(set(plugin.get("levels_visited") or [0]))
        row["level_changes"] = plugin.get("level_changes")
    return row


def _system_summary(
    name: str, runs: list[dict[str, Any]], ttft_bound_ms: float = TTFT_BOUND_MS
) -> dict[str, Any]:
    rows = [rate_row(r, ttft_bound_ms) for r in runs]
    rows.sort(key=lambda r: float(r["target_rate"] or 0.0))
    out: dict[str, Any] = {
        "max_sustainable_rps": max_sustainable_rate(rows),
        "knee": knee(rows),
        "failed_requests": sum(r["failed"] for r in rows),
        "rates": rows,
    }
    config = plugin_config(runs[0])
    if config is not None:
        link, target = link_of(config)
        calibrations = [(r.get("plugin") or {}).get("calibration") or {} for r in runs]
        achieved = [float(c["h2d_GBps"]) for c in calibrations if c.get("h2d_GBps")]
        out["link"] = link
        out["link_GBps_target"] = target
        out["link_GBps_achieved"] = round(min(achieved), 2) if achieved else None
        serving = [
            float(v) for r in runs if (v := (r.get("plugin") or {}).get("link_GBps_serving"))
        ]
        out["link_GBps_achieved_serving"] = round(min(serving), 1) if serving else None
        out["emulation"] = config.get("home") == "device"
        out["levels_visited"] = sorted({lv for r in rows for lv in r.get("levels_visited", [])})
        out["timelines"] = {
            str(rate_of(run.get("point") or {})): (run.get("plugin") or {}).get("level_timeline")
            or []
            for run in runs
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


# Per offered rate both systems ran: how the dynamic system's figures compare with stock's.
SAME_RATE_KEYS = {
    "throughput": "achieved_rate",  # higher is better
    "mean_e2el": "mean_e2el_ms",  # lower is better, and so on
    "p99_e2el": "p99_e2el_ms",
    "p99_ttft": "p99_ttft_ms",
    "median_tpot": "median_tpot_ms",
}


def at_same_rate(ours: list[dict[str, Any]], stock: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dynamic system over stock at every offered rate both ran, sustained or not. A
    single overloaded point has no max sustainable rate on either side (the H100's long
    outputs, 2026-12-06: both queues grew), yet the same arrivals served faster are a
    result; these ratios say by how much, and the max sustainable rates stay the goal."""
    by_rate = {row["target_rate"]: row for row in stock}
    out = []
    for row in ours:
        base = by_rate.get(row["target_rate"])
        if base is None:
            continue
        ratios = {name: _ratio(row.get(key), base.get(key)) for name, key in SAME_RATE_KEYS.items()}
        both = bool(row["sustainable"]) and bool(base["sustainable"])
        out.append({"target_rate": row["target_rate"], "both_sustained": both, **ratios})
    return out


def compare(systems: dict[str, Any]) -> dict[str, Any]:
    """Per link: the dynamic system against stock and against the best static level."""
    stock = systems.get("stock", {}).get("max_sustainable_rps")
    out: dict[str, Any] = {}
    for name, data in systems.items():
        if not name.startswith("dynamic@"):
            continue
        link = name.split("@", 1)[1]
        statics = {
            n: d["max_sustainable_rps"]
            for n, d in systems.items()
            if n.startswith("static_k") and n.endswith("@" + link)
        }
        best = max(statics, key=lambda n: statics[n] or 0.0, default=None)
        ours = data["max_sustainable_rps"]
        out[link] = {
            "emulation": data["emulation"],
            "dynamic_over_stock": _ratio(ours, stock),
            "best_static": best,
            "dynamic_over_best_static": _ratio(ours, statics.get(best)) if best else None,
            "exact": data["knee"] is not None and systems.get("stock", {}).get("knee") is not None,
            "at_same_rate": at_same_rate(data["rates"], systems.get("stock", {}).get("rates", [])),
        }
    ceilings = [n for n in systems if n.startswith("stock_")]
    if ceilings:
        top = max(ceilings, key=lambda n: systems[n]["max_sustainable_rps"] or 0.0)
        out["ceiling"] = {
            "system": top,
            "ceiling_over_stock": _ratio(systems[top]["max_sustainable_rps"], stock),
        }
    return out


def report(
    paths: list[str], interference: str | None = None, ttft_bound_ms: float = TTFT_BOUND_MS
) -> dict[str, Any]:
    runs = [read_results(path) for path in paths]
    gpus = {str((r.get("machine") or {}).get("gpu")) for r in runs} - {"None"}
    if len(gpus) > 1:  # a ratio compares runs of one machine
        raise ValueError(
            f"the runs come from several GPUs ({', '.join(sorted(gpus))}): report each "
            "card's runs apart (one bench.fastlink per card)"
        )
    utils = [utilization(r) for r in runs if plugin_config(r) is not None]
    plugin_util = max(set(utils), key=utils.count) if utils else None
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    commands = []
    for path, run in zip(paths, runs, strict=True):
        workload = str((run.get("point") or {}).get("workload", "?"))
        system = system_of(run, plugin_util)
        grouped.setdefault(workload, {}).setdefault(system, []).append(run)
        commands.append(
            {
                "file": str(path),
                "workload": workload,
                "system": system,
                "trace": (run.get("point") or {}).get("trace"),
                "server_command": run.get("server_command"),
            }
        )
    workloads: dict[str, Any] = {}
    for workload, by_system in sorted(grouped.items()):
        systems = {
            name: _system_summary(name, rs, ttft_bound_ms) for name, rs in sorted(by_system.items())
        }
        workloads[workload] = {"systems": systems, "ratios": compare(systems)}
    result: dict[str, Any] = {
        "emulation": any(
            s.get("emulation") for w in workloads.values() for s in w["systems"].values()
        ),
        "note": EMULATION_NOTE,
        "gpus": sorted(gpus),
        "gpu_memory_utilization": plugin_util,
        "sustained_rule": (
            "no failed request, the waiting queue's slope over the trace's arrivals below "
            f"2% of the offered rate, and P99 TTFT <= {ttft_bound_ms:g} ms"
        ),
        "workloads": workloads,
        "goals": goals(workloads),
        "runs": commands,
    }
    if interference:
        result["interference"] = read_results(interference)
    return result


def goals(workloads: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals where the runs allow them to be read (None: not run)."""
    out: dict[str, Any] = {}
    for workload, data in workloads.items():
        for link, ratios in data["ratios"].items():
            if link == "ceiling" or not ratios["emulation"]:
                continue
            over_stock, over_static = (
                ratios["dynamic_over_stock"],
                ratios["dynamic_over_best_static"],
            )
            out[f"{workload}@{link}"] = {
                "over_stock_ge_1.10": None if over_stock is None else over_stock >= 1.10,
                "over_best_static_ge_1.0": None if over_static is None else over_static >= 1.0,
            }
    return out


def card_name(gpu: str) -> str:
    """``h100`` for "NVIDIA H100 80GB HBM3", ``h200`` for "NVIDIA H200", else the name."""
    for word in gpu.replace("-", " ").split():
        if word[:1] in "HBG" and word[1:].isdigit():
            return word.lower()
    return gpu.lower().replace(" ", "_")


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """``fastlink_latency_<card>.png``: per workload, P99 and mean E2E against the offered
    rate, a line per system; ``fastlink_levels_<card>.png``: the dynamic systems' level over
    time. ``<card>`` names the runs' GPUs (``h100``), the emulation's host."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = result.get("gpus") or []  # one at most: report() refuses runs of two cards
    card = card_name(gpus[0]) if gpus else ""
    tag = f" (fast link EMULATED on one {card.upper() or 'GPU'})" if result["emulation"] else ""
    suffix = f"_{card}" if card else ""
    workloads = result["workloads"]
    width = max(7.0, 5.0 * len(workloads))
    fig, axes = plt.subplots(1, len(workloads), figsize=(width, 4.0), squeeze=False)
    for ax, (workload, data) in zip(axes[0], workloads.items(), strict=True):
        for system, summary in data["systems"].items():
            rows = [r for r in summary["rates"] if isinstance(r["target_rate"], float | int)]
            xs = [r["target_rate"] for r in rows]
            (line,) = ax.plot(xs, [r["p99_e2el_ms"] / 1e3 for r in rows], marker="o", label=system)
            means = [r["mean_e2el_ms"] / 1e3 for r in rows]
            ax.plot(xs, means, ls=":", marker="x", color=line.get_color())
        ax.set(xlabel="offered rate (req/s)", ylabel="E2E (s): P99 solid o, mean dotted x")
        ax.set_title(workload, fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle("Rate against latency under vllm serve" + tag, fontsize=10)
    fig.tight_layout()
    paths = [out_dir / f"fastlink_latency{suffix}.png"]
    save_figure(fig, paths[0])
    plt.close(fig)

    traces = [
        (f"{workload} {system} @ {rate} req/s", timeline)
        for workload, data in workloads.items()
        for system, summary in data["systems"].items()
        for rate, timeline in (summary.get("timelines") or {}).items()
        if system.startswith("dynamic@") and timeline
    ]
    if traces:
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for label, timeline in traces:
            ts = [t for t, _ in timeline]
            levels = [lv for _, lv in timeline]
            ax.step(ts, levels, where="post", label=label)
        ax.set(xlabel="seconds into the point", ylabel="offload level k")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title("The policy's level over time" + tag, fontsize=10)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        paths.append(out_dir / f"fastlink_levels{suffix}.png")
        save_figure(fig, paths[-1])
        plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="bench.serve_bench results (.json or .json.gz)")
    parser.add_argument("--interference", default=None, help="bench.interference's JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plots", default=None, help="folder for the PNGs")
    parser.add_argument(
        "--ttft-bound-ms", type=float, default=TTFT_BOUND_MS, help="a sustained rate's P99 TTFT"
    )
    args = parser.parse_args()
    try:
        result = report(args.runs, args.interference, args.ttft_bound_ms)
    except ValueError as exc:
        parser.error(str(exc))
    write_results(args.out, result)
    if args.plots:
        for path in plot(result, Path(args.plots)):
            print(f"wrote {path}")
    for workload, data in result["workloads"].items():
        for system, summary in data["systems"].items():
            print(
                f"{workload} {system}: max sustainable {summary['max_sustainable_rps']} req/s "
                f"(knee {summary['knee']}), failed {summary['failed_requests']}"
            )
        print(f"{workload} ratios: {data['ratios']}")
    if result["emulation"]:
        print(EMULATION_NOTE)


if __name__ == "__main__":
    main()
