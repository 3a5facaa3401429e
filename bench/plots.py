"""Plots of the microbenchmark results (PNG), the analogues of the seed's Figures 4 and 5 and
Table 1.

    python -m bench.plots bench/results/microbench_*_h200.json --out bench/results/plots

* ``microbench_h2d.png``: achieved H2D throughput of the prefetches against offloaded layers,
  with the link peak measured in the same run;
* ``microbench_iteration.png``: decode, prefill and mixed iteration time against offloaded
  layers, KV capacity (GiB) on a second axis, one panel per model;
* ``microbench_resize.png``: a table of level-change costs (wall, driver calls, waiting for
  queued work, restoring layers, page slots remapped).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _load(paths: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
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
    for name, data in runs:
        rows = [r for r in _levels(data) if r.get("h2d_GBps")]
        if not rows:
            continue
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
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # CPU runs copy synchronously and time nothing
        ax.text(0.5, 0.5, "no timed transfers (CPU run)", ha="center", transform=ax.transAxes)
    ax.set_title("Prefetch transfer throughput vs offload depth")
    path = out / "microbench_h2d.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
    fig.savefig(path, dpi=120)
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = _load(args.results)
    for path in (
        plot_h2d(runs, args.out),
        plot_iteration(runs, args.out),
        plot_resize(runs, args.out),
    ):
        print(path)


if __name__ == "__main__":
    main()
