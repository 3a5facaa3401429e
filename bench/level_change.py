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

``schedule`` prints a ``level_schedule`` that forces changes up and down under load, and
``soak`` one that hops across levels at random (one level per change, as the controller
moves), for the soak of the hardening issue:

    python -m bench.level_change schedule --start 300 --every 40 --cycles 24
    python -m bench.level_change soak --start 300 --every 12 --changes 1000 --level 4

``--soak-report RUN.json`` turns a soak run of ``bench.serve_bench`` into
``bench/results/soak_h200.json`` (level changes, failed requests, resize failures and how
many of them the server recovered from).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Any

from bench.common import read_results, write_results
from bench.serve_bench import disconnected_failures


def forced_schedule(start: int, every: int, cycles: int, level: int = 1) -> list[list[int]]:
    """``cycles`` round trips 0 -> ``level`` -> 0, one change every ``every`` steps."""
    schedule = []
    for n in range(cycles):
        schedule.append([start + 2 * n * every, level])
        schedule.append([start + (2 * n + 1) * every, 0])
    return schedule


def soak_schedule(start: int, every: int, changes: int, top: int, seed: int = 0) -> list[list[int]]:
    """``changes`` moves of one level, every ``every`` steps, a random walk over 0..``top``
    (seeded): each entry is one change for the controller."""
    rng = random.Random(seed)
    level, schedule = 0, []
    for n in range(changes):
        if level == 0:
            level = 1
        elif level == top:
            level = top - 1
        else:
            level += rng.choice((-1, 1))
        schedule.append([start + n * every, level])
    return schedule


def soak_report(path: str) -> dict[str, Any]:
    """The soak's acceptance figures from one ``bench.serve_bench`` run."""
    run = read_results(path)
    plugin = run.get("plugin") or {}
    client = run.get("client") or {}
    failures = int(plugin.get("resize_failures", 0))
    failed = int(client.get("failed", -1))
    return {
        "level_changes": int(plugin.get("level_changes", 0)),
        "failed_requests": failed,
        # of those, requests whose connection closed before any response (serve_bench)
        "failed_disconnected": disconnected_failures(client),
        "completed_requests": int(client.get("completed", 0)),
        "resize_failures": failures,
        # A failed resize leaves the server at its old level, serving on; the run finished
        # its trace with no failed request, so every failure was recovered from.
        "recovered": failures if failed == 0 else None,
        "levels_visited": sorted(set(plugin.get("levels_visited", []))),
        "command": run.get("command"),
        "machine": run.get("machine"),
    }


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
    parser.add_argument("--changes", type=int, default=1000, help="soak: level changes")
    parser.add_argument("--soak-report", default=None, help="a soak run -> --out")
    args = parser.parse_args()
    if args.runs == ["schedule"]:
        print(json.dumps(forced_schedule(args.start, args.every, args.cycles, args.level)))
        return
    if args.runs == ["soak"]:
        print(json.dumps(soak_schedule(args.start, args.every, args.changes, args.level)))
        return
    if args.soak_report:
        report_ = soak_report(args.soak_report)
        write_results(args.out, report_)
        print(json.dumps({k: v for k, v in report_.items() if k != "machine"}))
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
