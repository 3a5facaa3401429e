"""The level-change report: what each change costs the engine under load, per model and
direction, from ``bench.serve_bench`` runs whose plugin changed level.

    python -m bench.level_change RUN.json [RUN.json ...] --out bench/results/level_change_h200.json

Per model and direction (``up``: k -> k+1, ``down``: k+1 -> k) it gives the median and the
maximum over the changes of

* ``stall_ms``: the change after the queued work drained, while the device waits for the
  next step's launch (the trace's ``stall_ms``);
* ``blocked_ms``: the whole change on the engine's thread, the wait for the step still
  running included (the trace's ``remap_ms``);
* ``driver_ms``: inside the VMM driver's calls;

and next to them the reclaim group (blocks and tokens a drain frees at once) and the page,
from the server's ``plan`` event. Runs are grouped by model and KV layout (``per_layer``,
``packed``), so a before and an after of the same model sit side by side; ``within_goal``
says whether both medians meet the level-change issue's goal (stall <= 20 ms, driver <= 10
ms per change).

``schedule`` prints a ``level_schedule`` that forces changes up and down under load:

    python -m bench.level_change schedule --start 300 --every 40 --cycles 24
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from bench.common import read_results, write_results


def forced_schedule(start: int, every: int, cycles: int, level: int = 1) -> list[list[int]]:
    """``cycles`` round trips 0 -> ``level`` -> 0, one change every ``every`` steps."""
    schedule = []
    for n in range(cycles):
        schedule.append([start + 2 * n * every, level])
        schedule.append([start + (2 * n + 1) * every, 0])
    return schedule


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}


GOAL_MS = {"stall_ms": 20.0, "driver_ms": 10.0}  # medians per change


def report(paths: list[str]) -> dict[str, Any]:
    models: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        run = read_results(path)
        plugin = run.get("plugin") or {}
        changes = plugin.get("level_change_stall_ms") or []
        name = str(run.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]
        layout = (plugin.get("plan") or {}).get("kv_layout") or (run.get("point") or {}).get(
            "kv_layout", "?"
        )
        entry = models.setdefault((name, layout), {"runs": [], "changes": {"up": [], "down": []}})
        entry["runs"].append({"file": str(path), "command": run.get("command")})
        if plugin.get("plan"):
            plan = plugin["plan"]
            entry["reclaim_group"] = {
                "blocks": plan["group_blocks"],
                "tokens": plan["group_tokens"],
                "page_size_mib": plan["page_size"] / 2**20,
                "kv_layout": plan["kv_layout"],
            }
        for change in changes:
            direction = "up" if change["to"] > change["from"] else "down"
            entry["changes"][direction].append(change)
    out: dict[str, Any] = {"goal_ms": GOAL_MS, "models": {}}
    for (name, layout), entry in sorted(models.items()):
        row: dict[str, Any] = {"runs": entry["runs"], "reclaim_group": entry.get("reclaim_group")}
        for direction, changes in entry["changes"].items():
            row[direction] = {
                "changes": len(changes),
                # a change down's stall includes the device's wait for its restore copy
                # only where the trace recorded that wait (traces before 2026-12-05 lost it
                # when it came in the same report as the change)
                **(
                    {"restore_wait_recorded": sum("restore_wait_ms" in c for c in changes)}
                    if direction == "down"
                    else {}
                ),
                **{
                    key: _stats([c[key] for c in changes if key in c])
                    for key in ("stall_ms", "blocked_ms", "driver_ms")
                },
            }
        row["within_goal"] = all(
            row[d][key] is not None and row[d][key]["median"] <= limit
            for d in ("up", "down")
            for key, limit in GOAL_MS.items()
        )
        out["models"].setdefault(name, {})[layout] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="serve_bench results (or: schedule)")
    parser.add_argument("--out", default="bench/results/level_change_h200.json")
    parser.add_argument("--start", type=int, default=300, help="schedule: first change's step")
    parser.add_argument("--every", type=int, default=40, help="schedule: steps between changes")
    parser.add_argument("--cycles", type=int, default=24, help="schedule: round trips")
    parser.add_argument("--level", type=int, default=1, help="schedule: the level visited")
    args = parser.parse_args()
    if args.runs == ["schedule"]:
        print(json.dumps(forced_schedule(args.start, args.every, args.cycles, args.level)))
        return
    if not args.runs:
        parser.error("give the serve_bench runs to report on (or: schedule)")
    result = report(args.runs)
    path = write_results(args.out, result)
    for name, layouts in result["models"].items():
        for layout, row in layouts.items():
            medians = {
                d: {k: (row[d][k] or {}).get("median") for k in ("stall_ms", "driver_ms")}
                for d in ("up", "down")
            }
            print(
                f"{name} {layout}: {json.dumps(medians)} group {row['reclaim_group']} "
                f"within goal: {row['within_goal']}"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
