"""One regime's serving results in one file: each system's sweep, its maximum sustainable rate
and the ratios the README quotes.

    python -m bench.serving_report bench/results/serving/qwen3-32b_b_sharegpt/*.json \\
        --regime b --out bench/results/serving_qwen3-32b_b_h200.json

Every rate is scored again from its stored queue samples with the current definition
(``bench.serving.DEFINITION``), so runs recorded under an older rule are judged by the same
one. Several files of one system (a sweep split over two calls) are merged by rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import write_results
from bench.serving import DEFINITION, SYSTEMS, max_sustainable_rate, queue_slope, sustainable

ROW_KEYS = (
    "target_rate",
    "achieved_rate",
    "sustainable",
    "queue_slope",
    "arrivals_in_window",
    "completed_in_window",
    "ttft_ms",
    "tbt_ms",
    "e2e_ms",
)
OURS = "dynamic"


def rescore(entry: dict[str, Any]) -> dict[str, Any]:
    t0, t1 = entry["window"]
    slope = queue_slope(entry["queue_samples"], t0, t1)
    return {
        **entry,
        "queue_slope": round(slope, 3),
        "sustainable": sustainable(slope, entry["target_rate"]),
    }


def load_systems(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Per system: its runs merged by rate (a later file wins a rate both measured)."""
    systems: dict[str, dict[str, Any]] = {}
    for path in paths:
        run = json.loads(path.read_text())
        name = run["system"]
        if name not in SYSTEMS:
            raise SystemExit(f"{path}: unknown system {name!r}")
        merged = systems.setdefault(
            name, {"system": name, "rates": {}, "sources": [], "trace": [], "engine": None}
        )
        for entry in run["rates"]:
            merged["rates"][entry["target_rate"]] = rescore(entry)
        merged["sources"].append(
            {
                "file": path.name,
                "command": run["command"],
                "machine": run["machine"],
                "startup_s": run["startup_s"],
                "settings": run["settings"],
                "partial": run.get("partial", False),
            }
        )
        merged["trace"] = run.get("trace") or merged["trace"]
        merged["engine"] = run.get("engine") or merged["engine"]
        for key in ("model", "workload", "gpu_memory_utilization"):
            merged[key] = run[key]
    for merged in systems.values():
        merged["rates"] = [merged["rates"][r] for r in sorted(merged["rates"])]
        merged["max_sustainable_rate"] = max_sustainable_rate(merged["rates"])
    return systems


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def report(systems: dict[str, dict[str, Any]], regime: str) -> dict[str, Any]:
    top = {name: run["max_sustainable_rate"] for name, run in systems.items()}
    first = next(iter(systems.values()))
    ours = top.get(OURS)
    return {
        "model": first["model"],
        "regime": regime,
        "gpu_memory_utilization": first["gpu_memory_utilization"],
        "workload": first["workload"],
        "definition": DEFINITION,
        "max_sustainable_rate": top,
        "ratios": {
            "dynamic_over_stock": _ratio(ours, top.get("stock")),
            "dynamic_over_static": _ratio(ours, top.get("static")),
            "dynamic_over_stock_piecewise": _ratio(ours, top.get("stock-piecewise")),
            "dynamic_over_prefetch": _ratio(ours, top.get("prefetch")),
        },
        "missing_systems": [s for s in SYSTEMS if s not in systems],
        "systems": {
            name: {
                "max_sustainable_rate": run["max_sustainable_rate"],
                "engine": run["engine"],
                "levels_seen": sorted({r["level"] for r in run["trace"]}) if run["trace"] else None,
                "kv_util_max": max((r["kv_util"] for r in run["trace"]), default=None),
                "sources": run["sources"],
                "rates": [{k: r[k] for k in ROW_KEYS} for r in run["rates"]],
            }
            for name, run in systems.items()
        },
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| system | max sustainable req/s | rates offered (achieved, ✓ sustainable) |",
        "| --- | --- | --- |",
    ]
    for name, run in result["systems"].items():
        cells = ", ".join(
            f"{r['target_rate']:g} ({r['achieved_rate']:g}{' ✓' if r['sustainable'] else ''})"
            for r in run["rates"]
        )
        top = run["max_sustainable_rate"]
        lines.append(f"| {name} | {top if top is not None else 'none'} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--regime", required=True, help="a (whole H200) or b (GH200-sized)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = report(load_systems(args.results), args.regime)
    write_results(args.out, result)
    print(markdown(result))
    print(json.dumps(result["ratios"]))


if __name__ == "__main__":
    main()
