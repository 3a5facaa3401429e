"""One regime's serving results in one file: each system's sweep, its maximum sustainable rate
and the ratios the README quotes.

    python -m bench.serving_report bench/results/serving/qwen3-32b_b_sharegpt/*.json.gz \\
        --regime b --out bench/results/serving_qwen3-32b_b_h200.json

Every rate is scored again from its stored queue samples with the current definition
(``bench.serving.DEFINITION``), so runs recorded under an older rule are judged by the same
one. Several files of one system (a sweep split over two calls) are merged by rate.

For a system with the plugin's per-step trace, the report also bins the steps by running batch
(``batch_bands``): step time, and requests advanced per second (running ÷ step time, close to
decode tokens per second). Where that figure stops rising as the batch grows, the engine is
bound by compute, not by KV: more KV blocks admit more requests without adding throughput.

It also summarises the steps served while the KV cache was nearly full (``step_mix``), per
offload level: how many carried a prefill chunk, what share of the time those took, and the
mean decode-only and prefill-carrying step. A level's copies hide behind the long prefill
steps and not behind the decode steps, so this mix is what one more level costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from bench.common import read_results, write_results
from bench.serving import (
    DEFINITION,
    SYSTEMS,
    max_sustainable_rate,
    queue_slope,
    sustainable,
    timed_forward,
)

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
# the systems ours is compared with: ratio key -> system name
BASELINES = {
    "stock": "stock",
    "static": "static",
    "stock_piecewise": "stock-piecewise",
    "prefetch": "prefetch",
}
BAND = 25  # requests per running-batch band
MIN_BAND_STEPS = 20  # fewer steps than this are noise, not a band
SATURATED_KV = 0.85  # step_mix: KV utilisation above which a step counts as saturated


def batch_bands(trace: list[dict[str, Any]], band: int = BAND) -> list[dict[str, Any]]:
    """The trace's steps binned by running batch: mean step time and throughput per band.

    A step's time is the gap to the next sample, so the last step is left out, and so are
    idle gaps (no request running)."""
    bins: dict[int, list[tuple[float, dict[str, Any]]]] = {}
    for sample, after in itertools.pairwise(trace):
        if sample["running"] > 0:
            step_s = after["t"] - sample["t"]
            bins.setdefault(sample["running"] // band, []).append((step_s, sample))
    rows = []
    for key in sorted(bins):
        steps = bins[key]
        if len(steps) < MIN_BAND_STEPS:
            continue
        step_s = sum(dt for dt, _ in steps) / len(steps)
        running = sum(s["running"] for _, s in steps) / len(steps)
        rows.append(
            {
                "running": [key * band, (key + 1) * band],
                "steps": len(steps),
                "step_ms": round(step_s * 1e3, 2),
                "running_mean": round(running, 1),
                "requests_per_s": round(running / step_s),
                "kv_util": round(sum(s["kv_util"] for _, s in steps) / len(steps), 3),
                "waiting": round(sum(s["waiting"] for _, s in steps) / len(steps), 1),
            }
        )
    return rows


def step_mix(trace: list[dict[str, Any]], kv_min: float = SATURATED_KV) -> list[dict[str, Any]]:
    """Per level, the timed steps served with KV utilisation above ``kv_min``: the share that
    carried prefill, the share of time they took, and the mean step of each kind (ms)."""
    by_level: dict[int, list[dict[str, Any]]] = {}
    for r in trace:
        if timed_forward(r) and r["kv_util"] > kv_min:
            by_level.setdefault(r["level"], []).append(r)
    rows = []
    for level in sorted(by_level):
        steps = by_level[level]
        if len(steps) < MIN_BAND_STEPS:
            continue
        prefill = [r["forward_ms"] for r in steps if r["prefill_tokens"]]
        decode = [r["forward_ms"] for r in steps if not r["prefill_tokens"]]
        total = sum(prefill) + sum(decode)
        rows.append(
            {
                "level": level,
                "steps": len(steps),
                "prefill_step_share": round(len(prefill) / len(steps), 3),
                "prefill_time_share": round(sum(prefill) / total, 3),
                "decode_step_ms": round(sum(decode) / len(decode), 2) if decode else None,
                "prefill_step_ms": round(sum(prefill) / len(prefill), 2) if prefill else None,
            }
        )
    return rows


def rescore(entry: dict[str, Any]) -> dict[str, Any]:
    t0, t1 = entry["window"]
    slope = queue_slope(entry["queue_samples"], t0, t1)
    return {
        **entry,
        "queue_slope": round(slope, 3),
        "sustainable": sustainable(slope, entry["target_rate"]),
    }


def setting(run: dict[str, Any]) -> dict[str, Any]:
    """What must match for two runs to be compared: model, workload, memory, batch limits."""
    engine = run.get("engine") or {}
    return {
        "model": run["model"],
        "workload": run["workload"].get("name"),
        "gpu_memory_utilization": run["gpu_memory_utilization"],
        "max_num_seqs": engine.get("max_num_seqs", "unrecorded"),
        "max_num_batched_tokens": engine.get("max_num_batched_tokens", "unrecorded"),
    }


def load_systems(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Per system: its runs merged by rate (a later file wins a rate both measured).

    Every file must come from the same setting (:func:`setting`); a mix would put, say,
    runs under the engine's 128-request cap next to runs under ``vllm serve``'s limits."""
    systems: dict[str, dict[str, Any]] = {}
    first: tuple[Path, dict[str, Any]] | None = None
    for path in paths:
        run = read_results(path)
        name = run["system"]
        if name not in SYSTEMS:
            raise SystemExit(f"{path}: unknown system {name!r}")
        here = setting(run)
        if first is None:
            first = (path, here)
        elif here != first[1]:
            diff = [f"{k} {v!r} vs {here[k]!r}" for k, v in first[1].items() if here[k] != v]
            raise SystemExit(
                f"{path} was measured in another setting than {first[0]}: " + ", ".join(diff)
            )
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


KNEE_RULE = (
    "a maximum is exact when the sweep offered a higher rate it could not sustain: its waiting "
    "queue grew (knee 'queue'), or it completed fewer requests per second than the best "
    "sustainable rate did (knee 'throughput': the backlog grows inside the running batch, "
    "as when the KV cache and max_num_seqs admit every arrival); otherwise it is a lower bound"
)


def knee(rates: list[dict[str, Any]]) -> str | None:
    """How the sweep passed its knee above its best sustainable rate (:data:`KNEE_RULE`).

    None when it did not: the system sustained every rate offered above its best one and
    kept completing more, so its maximum sustainable rate is only a lower bound."""
    best = max(
        (r for r in rates if r["sustainable"]), key=lambda r: r["achieved_rate"], default=None
    )
    if best is None:
        return "queue"  # no rate was sustainable
    above = [r for r in rates if r["target_rate"] > best["target_rate"]]
    if any(not r["sustainable"] for r in above):
        return "queue"
    if any(r["achieved_rate"] < best["achieved_rate"] for r in above):
        return "throughput"
    return None


def knee_reached(rates: list[dict[str, Any]]) -> bool:
    """Whether the maximum sustainable rate is exact rather than a lower bound."""
    return knee(rates) is not None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _bound(ours_exact: bool, theirs_exact: bool) -> str:
    """What ours ÷ theirs is when either maximum is only a lower bound."""
    if ours_exact and theirs_exact:
        return "exact"
    if ours_exact:
        return "upper bound"  # their maximum can only be higher
    if theirs_exact:
        return "lower bound"
    return "unbounded"


def report(systems: dict[str, dict[str, Any]], regime: str) -> dict[str, Any]:
    top = {name: run["max_sustainable_rate"] for name, run in systems.items()}
    knees = {name: knee(run["rates"]) for name, run in systems.items()}
    exact = {name: k is not None for name, k in knees.items()}
    first = next(iter(systems.values()))
    ours = top.get(OURS)
    return {
        "model": first["model"],
        "regime": regime,
        "gpu_memory_utilization": first["gpu_memory_utilization"],
        "workload": first["workload"],
        "definition": DEFINITION,
        "knee_rule": KNEE_RULE,
        "max_sustainable_rate": top,
        "ratios": {
            f"dynamic_over_{key}": _ratio(ours, top.get(name)) for key, name in BASELINES.items()
        },
        "ratio_bounds": {
            f"dynamic_over_{key}": _bound(exact[OURS], exact[name])
            for key, name in BASELINES.items()
            if top.get(OURS) is not None and top.get(name) is not None
        },
        "lower_bounds": [name for name, ok in exact.items() if not ok],
        "missing_systems": [s for s in SYSTEMS if s not in systems],
        "systems": {
            name: {
                "max_sustainable_rate": run["max_sustainable_rate"],
                "knee_reached": exact[name],
                "knee": knees[name],
                "engine": run["engine"],
                "levels_seen": sorted({r["level"] for r in run["trace"]}) if run["trace"] else None,
                "kv_util_max": max((r["kv_util"] for r in run["trace"]), default=None),
                "batch_bands": batch_bands(run["trace"]) if run["trace"] else None,
                "step_mix": step_mix(run["trace"]) if run["trace"] else None,
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
        shown = "none" if top is None else f"{top}" if run["knee_reached"] else f"≥ {top}"
        lines.append(f"| {name} | {shown} | {cells} |")
    for name, run in result["systems"].items():
        if not run["batch_bands"]:
            continue
        lines += [
            "",
            f"{name}, steps by running batch:",
            "",
            "| running | steps | step ms | running ÷ step time (/s) | KV util | waiting |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {b['running'][0]}-{b['running'][1]} | {b['steps']} | {b['step_ms']:g} "
            f"| {b['requests_per_s']} | {b['kv_util']:.2f} | {b['waiting']:g} |"
            for b in run["batch_bands"]
        ]
    for name, run in result["systems"].items():
        if not run["step_mix"]:
            continue
        lines += [
            "",
            f"{name}, steps served with KV utilisation above {SATURATED_KV}, by level:",
            "",
            "| level | steps | with prefill | their time | decode step ms | prefill step ms |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {m['level']} | {m['steps']} | {m['prefill_step_share']:.0%} "
            f"| {m['prefill_time_share']:.0%} | {m['decode_step_ms']} | {m['prefill_step_ms']} |"
            for m in run["step_mix"]
        ]
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
    print(json.dumps({"ratios": result["ratios"], "ratio_bounds": result["ratio_bounds"]}))


if __name__ == "__main__":
    main()
