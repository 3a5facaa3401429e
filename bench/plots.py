"""Plots (PNG) of the microbenchmark and serving results.

    python -m bench.plots microbench bench/results/microbench_*_h200.json --out bench/results/plots
    python -m bench.plots serving bench/results/serving/qwen3-32b_b_sharegpt/*.json.gz \
        --out bench/results/plots --name serving_qwen3-32b_b_sharegpt [--cdf-rate 14]

Microbenchmark (the analogues of the seed's Figures 4 and 5 and Table 1):

* ``microbench_h2d.png``: achieved H2D throughput of the prefetches against offloaded layers,
  with the link peak measured in the same run;
* ``microbench_iteration.png``: decode, prefill and mixed iteration time against offloaded
  layers, KV capacity (GiB) on a second axis, one panel per model;
* ``microbench_resize.png``: a table of level-change costs (wall, driver calls, waiting for
  queued work, restoring layers, page slots remapped).

Serving (one file per system, same model, memory and workload):

* ``<name>_latency.png``: median and P99 TTFT, TBT and E2E against achieved rate;
* ``<name>_cdf.png``: TTFT and E2E CDFs at one target rate (default: the lowest rate at
  which stock vLLM is not sustainable, i.e. above its saturation);
* ``<name>_trace.png``: the plugin's level, KV utilisation and waiting queue over time;
* ``<name>_batch.png``: step time and running ÷ step time against the running batch, coloured by
  KV utilisation (``bench.serving_report.batch_bands``): where the second stops rising, more
  KV would admit more requests without adding throughput.

Simulator (``bench/results/simulator.json``; every figure a **simulation**):

    python -m bench.plots simulator bench/results/simulator.json --out bench/results/plots

* ``simulator_validation.png``: each held-back point's error, predicted against
  measured, per metric and system, with the fast-link issue's bounds;
* ``simulator_predictions.png``: P99 TTFT and throughput against the offered rate, stock and
  the plugin on each link, for Qwen3-32B's ShareGPT and long-output sweeps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.common import read_results, save_figure


def _load(paths: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    runs = []
    for path in paths:
        data = read_results(path)
        runs.append(
            (
                Path(data["model"]).name
                + (f" {data['quantization']}" if data.get("quantization") else ""),
                data,
            )
        )
    return runs


def _levels(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for k, v in sorted(data["levels"].items(), key=lambda kv: _key(kv[0])) if k != "0p"]


def _key(level: str) -> float:
    return 0.5 if level == "0p" else float(level)


def plot_h2d(runs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    top = 1.0
    for name, data in runs:
        rows = [r for r in _levels(data) if r.get("h2d_GBps")]
        if not rows:
            continue
        top = max([top, rows[0]["h2d_peak_GBps"], *(r["h2d_GBps"] for r in rows)])
        line = ax.plot(
            [r["offloaded_layers"] for r in rows], [r["h2d_GBps"] for r in rows], "o-", label=name
        )
        ax.axhline(
            rows[0]["h2d_peak_GBps"],
            color=line[0].get_color(),
            ls="--",
            lw=1,
            label=f"{name}: link peak",
        )
    ax.set_xlabel("offloaded layers (2k)")
    ax.set_ylabel("H2D throughput of prefetches (GB/s)")
    ax.set_ylim(0, 1.25 * top)  # room above the peak lines for the legend
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    else:  # CPU runs copy synchronously and time nothing
        ax.text(0.5, 0.5, "no timed transfers (CPU run)", ha="center", transform=ax.transAxes)
    ax.set_title("Prefetch transfer throughput vs offload depth")
    path = out / "microbench_h2d.png"
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_iteration(runs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.0 * len(runs), 4.2), squeeze=False)
    for ax, (name, data) in zip(axes[0], runs, strict=True):
        rows = _levels(data)
        xs = [r["offloaded_layers"] for r in rows]
        for key, style in (("decode_ms", "o-"), ("prefill_ms", "s-"), ("mixed_ms", "^-")):
            points = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=key.removesuffix("_ms"))
        predicted = [
            (x, r["decode_ms_predicted"])
            for x, r in zip(xs, rows, strict=True)
            if r.get("decode_ms_predicted")
        ]
        if predicted:
            ax.plot(*zip(*predicted, strict=True), "k:", label="decode, latency model")
        ax.set_xlabel("offloaded layers (2k)")
        ax.set_ylabel("iteration time (ms)")
        ax.grid(alpha=0.3)
        kv = ax.twinx()
        kv.plot(
            xs, [r["kv_capacity_gib"] for r in rows], "d--", color="tab:gray", label="KV capacity"
        )
        kv.set_ylabel("KV capacity (GiB)")
        lines, labels = ax.get_legend_handles_labels()
        more, more_labels = kv.get_legend_handles_labels()
        ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
        batch = data["workload"]["decode_batch"]
        ax.set_title(f"{name}: iteration time (decode batch {batch}) and KV capacity")
    path = out / "microbench_iteration.png"
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def resize_rows(runs: list[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for name, data in runs:
        for direction, up in (("k -> k+1", True), ("k+1 -> k", False)):
            costs = [
                c
                for key, c in data["resize"].items()
                if (int(key.split("->")[1]) > int(key.split("->")[0])) == up
            ]
            if not costs:
                continue

            def med(field: str, costs: list[dict[str, Any]] = costs) -> str:
                return f"{statistics.median(c[field] for c in costs):.1f}"

            rows.append(
                [
                    name,
                    direction,
                    str(len(costs)),
                    med("remap_ms"),
                    med("driver_ms"),
                    med("sync_ms"),
                    med("copy_ms"),
                    f"{statistics.median(c['slots_changed'] for c in costs):.0f}",
                ]
            )
    return rows


def plot_resize(runs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    header = ["model", "transition", "n", "wall ms", "driver ms", "wait ms", "restore ms", "slots"]
    rows = resize_rows(runs)
    fig, ax = plt.subplots(figsize=(9.0, 0.5 + 0.35 * (len(rows) + 1)))
    ax.axis("off")
    table = ax.table(cellText=rows or [["-"] * len(header)], colLabels=header, loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1.0, 1.3)
    ax.set_title("Level-change cost (median over transitions, in vLLM)", fontsize=10)
    path = out / "microbench_resize.png"
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_serving(paths: list[Path], out: Path, name: str, cdf_rate: float | None) -> list[Path]:
    import matplotlib.pyplot as plt

    from bench.serving import timed_forward
    from bench.serving_report import batch_bands, knee_reached, load_systems

    runs = list(load_systems(paths).values())  # rescored, one per system
    written = []
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [run["system"] for run in runs]
    tops = [run["max_sustainable_rate"] or 0.0 for run in runs]
    exact = [knee_reached(run["rates"]) for run in runs]
    bars = ax.barh(
        names,
        tops,
        color=["tab:green" if n == "dynamic" else "tab:gray" for n in names],
        hatch=["" if e else "//" for e in exact],
    )
    bar_labels = [f"{t:.2f}" if e else f"≥ {t:.2f}" for t, e in zip(tops, exact, strict=True)]
    ax.bar_label(bars, labels=bar_labels, padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("max sustainable rate (req/s); ≥, hatched: every offered rate sustained")
    ax.set_xlim(0, max([*tops, 1.0]) * 1.2)
    fig.suptitle(f"{name}: max sustainable rate")
    fig.tight_layout()
    written.append(out / f"{name}_maxrate.png")
    save_figure(fig, written[-1])
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, metric in zip(axes, ("ttft_ms", "tbt_ms", "e2e_ms"), strict=True):
        for run in runs:
            rates = run["rates"]
            xs = [r["achieved_rate"] for r in rates]
            p50 = [r[metric]["p50"] for r in rates]
            line = ax.plot(xs, p50, "o-", label=f"{run['system']} p50")
            p99 = [r[metric]["p99"] for r in rates]
            ax.plot(xs, p99, "x--", color=line[0].get_color(), label=f"{run['system']} p99")
        ax.set_yscale("log")
        ax.set_xlabel("achieved rate (req/s)")
        ax.set_ylabel(metric.replace("_ms", " (ms)").upper())
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{name}: latency vs achieved rate")
    fig.tight_layout()
    written.append(out / f"{name}_latency.png")
    save_figure(fig, written[-1])
    plt.close(fig)

    if cdf_rate is None:  # the lowest offered rate stock vLLM cannot sustain
        stock = next((r for r in runs if r["system"] == "stock"), runs[0])
        over = [r["target_rate"] for r in stock["rates"] if not r["sustainable"]]
        cdf_rate = min(over) if over else max(r["target_rate"] for r in stock["rates"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    for ax, metric in zip(axes, ("ttft", "e2e"), strict=True):
        for run in runs:
            entry = next((r for r in run["rates"] if r["target_rate"] == cdf_rate), None)
            if entry and entry["cdf_ms"][metric]:
                values = entry["cdf_ms"][metric]
                fractions = [i / (len(values) - 1) for i in range(len(values))]
                ax.plot(values, fractions, label=run["system"])
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: CDF at {cdf_rate:g} req/s offered")
    fig.tight_layout()
    written.append(out / f"{name}_cdf.png")
    save_figure(fig, written[-1])
    plt.close(fig)

    ours = [r for r in runs if r.get("trace")]
    if ours:
        # Traces that carry each step's forward get a fifth panel: the step times, decode-only
        # steps (dots) apart from prefill-carrying ones (crosses), where a level's copies show.
        timed = any(timed_forward(r) for run in ours for r in run["trace"])
        labels = ["offload level k", "KV utilisation", "waiting requests", "running requests"]
        if timed:
            labels.append("step time (ms, log)")
        fig, axes = plt.subplots(len(labels), 1, figsize=(11, 2.25 * len(labels)), sharex=True)
        for run, color in zip(
            ours, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False
        ):
            trace = run["trace"]
            ts = [r["t"] for r in trace]
            style = {"color": color, "label": run["system"]}
            axes[0].step(ts, [r["level"] for r in trace], where="post", **style)
            axes[1].plot(ts, [r["kv_util"] for r in trace], lw=0.8, **style)
            axes[2].plot(ts, [r["waiting"] for r in trace], lw=0.8, **style)
            axes[3].plot(ts, [r["running"] for r in trace], lw=0.8, **style)
            if timed:
                steps = [r for r in trace if timed_forward(r)]
                for decode_only, marker in ((True, "."), (False, "x")):
                    kind = [r for r in steps if (r["prefill_tokens"] == 0) == decode_only]
                    axes[4].scatter(
                        [r["t"] for r in kind],
                        [r["forward_ms"] for r in kind],
                        s=4 if decode_only else 10,
                        marker=marker,
                        color=color,
                        alpha=0.6,
                    )
        if timed:
            axes[4].set_yscale("log")
        for ax, label in zip(axes, labels, strict=True):
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        axes[-1].set_xlabel("engine time (s)")
        fig.suptitle(f"{name}: the plugin over time")
        fig.tight_layout()
        written.append(out / f"{name}_trace.png")
        save_figure(fig, written[-1])
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
        for run, marker in zip(ours, "os^vD", strict=False):
            bands = batch_bands(run["trace"])
            xs = [b["running_mean"] for b in bands]
            kv = [b["kv_util"] for b in bands]
            for ax, key in zip(axes, ("step_ms", "requests_per_s"), strict=True):
                ys = [b[key] for b in bands]
                ax.plot(xs, ys, "-", color="lightgray", zorder=1)
                dots = ax.scatter(
                    xs,
                    ys,
                    c=kv,
                    cmap="viridis",
                    vmin=0,
                    vmax=1,
                    marker=marker,
                    zorder=2,
                    edgecolors="black",
                    linewidths=0.4,
                    label=run["system"],
                )
        axes[0].legend(fontsize=8)
        axes[0].set_ylabel("mean step time (ms)")
        axes[1].set_ylabel("running ÷ step time (1/s)")
        for ax in axes:
            ax.set_xlabel("running requests (band mean)")
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        fig.colorbar(dots, ax=axes, label="KV utilisation")
        fig.suptitle(f"{name}: where more KV stops paying ({', '.join(r['system'] for r in ours)})")
        written.append(out / f"{name}_batch.png")
        save_figure(fig, written[-1])
        plt.close(fig)
    return written


VALIDATION_METRICS = {  # metric: (label, the fast-link issue's bound, or None)
    "request_throughput": ("throughput", 0.10),
    "median_e2el_ms": ("median E2E", 0.15),
    "p99_e2el_ms": ("P99 E2E", 0.15),
    "p99_ttft_ms": ("P99 TTFT", None),
    "median_tpot_ms": ("median TPOT", None),
}


def plot_simulator_validation(result: dict[str, Any], out: Path) -> Path:
    """One panel per metric: each point's error (predicted / measured - 1), per system."""
    import matplotlib.pyplot as plt

    entries = result["validation"]
    points = list(dict.fromkeys(e["point"] for e in entries))
    systems = list(dict.fromkeys(e.get("system", "stock") for e in entries))
    fig, axes = plt.subplots(
        1, len(VALIDATION_METRICS), figsize=(3.0 * len(VALIDATION_METRICS), 3.4)
    )
    width = 0.8 / len(systems)
    for ax, (metric, (label, bound)) in zip(axes, VALIDATION_METRICS.items(), strict=True):
        for i, system in enumerate(systems):
            errors = {
                e["point"]: 100 * e["error"][metric]
                for e in entries
                if e.get("system", "stock") == system and metric in e["error"]
            }
            xs = [p + (i - (len(systems) - 1) / 2) * width for p in range(len(points))]
            ax.bar(xs, [errors.get(pt, 0.0) for pt in points], width, label=system)
        if bound is not None:
            for y in (-100 * bound, 100 * bound):
                ax.axhline(y, color="k", ls="--", lw=1)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(points)), [pt.replace("_", "\n") for pt in points], fontsize=7)
        ax.set_title(label + (f" (bound ±{bound:.0%})" if bound else ""), fontsize=9)
    axes[0].set_ylabel("predicted / measured - 1 (%)")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "SIMULATION against held-back runs of Qwen3-32B under vllm serve: H200 at 0.62 over "
        "PCIe; h100_*: an H100, the plugin on an EMULATED fast link",
        fontsize=9,
    )
    fig.tight_layout()
    path = out / "simulator_validation.png"
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_simulator_predictions(result: dict[str, Any], out: Path) -> Path:
    """Per workload: P99 TTFT (log) and throughput against the offered rate, per system."""
    import matplotlib.pyplot as plt

    sweeps = {
        name: sweep
        for name, sweep in result["predictions"].items()
        if isinstance(sweep.get("stock"), dict) and "points" in sweep["stock"]
    }
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5.0 * len(sweeps), 6.4), squeeze=False)
    bound_s = result.get("predictions_ttft_bound_ms", 1000.0) / 1e3
    for col, (name, sweep) in enumerate(sweeps.items()):
        top, bottom = axes[0][col], axes[1][col]
        for system, rows in sweep.items():
            if not isinstance(rows, dict) or "points" not in rows:
                continue
            points = rows["points"]
            rates = [p["rate"] for p in points]
            label = f"{system} (max {rows['max_sustainable_rps']:g} req/s)"
            style = "k-o" if system == "stock" else "-o"
            top.plot(rates, [p["p99_ttft_ms"] / 1e3 for p in points], style, ms=3, label=label)
            bottom.plot(rates, [p["request_throughput"] for p in points], style, ms=3)
        top.axhline(bound_s, color="grey", ls="--", lw=1)
        top.set_yscale("log")
        top.set_title(f"SIMULATION: {name}", fontsize=9)
        top.set_ylabel("P99 TTFT (s; dashed: the sustained bound)")
        top.legend(fontsize=7)
        bottom.set_xlabel("offered rate (req/s)")
        bottom.set_ylabel("throughput (req/s)")
    fig.tight_layout()
    path = out / "simulator_predictions.png"
    save_figure(fig, path)
    plt.close(fig)
    return path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["microbench", "serving", "simulator"])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="serving", help="serving: file name prefix")
    parser.add_argument("--cdf-rate", type=float, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kind == "serving":
        paths = plot_serving(args.results, args.out, args.name, args.cdf_rate)
    elif args.kind == "simulator":
        result = read_results(args.results[0])
        paths = [plot_simulator_validation(result, args.out)]
        paths.append(plot_simulator_predictions(result, args.out))
    else:
        runs = _load(args.results)
        paths = [plot_h2d(runs, args.out), plot_iteration(runs, args.out)]
        paths.append(plot_resize(runs, args.out))
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
