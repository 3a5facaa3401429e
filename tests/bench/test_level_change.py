"""The level-change report and its forced schedule, on hand-made serve_bench records."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from bench.level_change import forced_schedule, report


def test_the_schedule_goes_up_and_down_at_fixed_steps() -> None:
    assert forced_schedule(100, 10, 2, level=2) == [[100, 2], [110, 0], [120, 2], [130, 0]]


def test_changes_are_split_by_direction_with_median_and_max(tmp_path: Path) -> None:
    changes = [
        {"from": 0, "to": 1, "stall_ms": s, "blocked_ms": 40.0, "driver_ms": 3.0}
        for s in (4.0, 5.0, 9.0)
    ] + [{"from": 1, "to": 0, "stall_ms": 25.0, "blocked_ms": 60.0, "driver_ms": 3.5}]
    plan = {"group_blocks": 15, "group_tokens": 240, "page_size": 30 << 20, "kv_layout": "packed"}
    run = {
        "model": "/tmp/site/models/qwen3-32b",
        "command": "x",
        "plugin": {"level_change_stall_ms": changes, "plan": plan},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    row = report([str(path)])["models"]["qwen3-32b"]["packed"]
    assert row["up"]["changes"] == 3 and row["up"]["stall_ms"] == {"median": 5.0, "max": 9.0}
    assert row["down"]["stall_ms"] == {"median": 25.0, "max": 25.0}
    assert row["down"]["restore_wait_recorded"] == 0  # the report says what it lacks
    assert row["within_goal"] is False  # down: 25 ms median stall, over 20
    assert row["reclaim_group"] == {
        "blocks": 15,
        "tokens": 240,
        "page_size_mib": 30.0,
        "kv_layout": "packed",
    }


def test_layouts_of_one_model_are_reported_apart(tmp_path: Path) -> None:
    paths = []
    for layout, stall in (("per_layer", 90.0), ("packed", 6.0)):
        run = {
            "model": "qwen3-8b",
            "point": {"kv_layout": layout},
            "plugin": {
                "level_change_stall_ms": [
                    {"from": 0, "to": 1, "stall_ms": stall, "driver_ms": 2.0},
                    {"from": 1, "to": 0, "stall_ms": stall, "driver_ms": 2.0},
                ]
            },
        }
        paths.append(tmp_path / f"{layout}.json")
        paths[-1].write_text(json.dumps(run))
    rows = report([str(p) for p in paths])["models"]["qwen3-8b"]
    assert rows["per_layer"]["up"]["stall_ms"]["median"] == 90.0
    assert rows["packed"]["down"]["stall_ms"]["median"] == 6.0
    assert rows["packed"]["within_goal"] and not rows["per_layer"]["within_goal"]


def test_a_restore_wait_after_a_change_down_counts_in_its_stall() -> None:
    from bench.serve_bench import change_stalls

    def change(a: int, b: int, stall: float) -> dict:
        return {
            "event": "level_change",
            "from_level": a,
            "to_level": b,
            "remap_ms": 30.0,
            "stall_ms": stall,
            "driver_ms": 4.0,
        }

    events = [
        change(0, 1, 5.0),
        {"event": "restore_wait", "wait_ms": 9.0},  # after a change up: not its
        change(1, 0, 7.0),
        {"event": "restore_wait", "wait_ms": 2.5},
        {"event": "restore_wait", "wait_ms": 0.5},
    ]
    up, down = change_stalls(events)
    assert up["stall_ms"] == 5.0 and "restore_wait_ms" not in up
    assert down["stall_ms"] == 10.0 and down["restore_wait_ms"] == 3.0


def test_the_soak_hops_one_level_per_change_within_bounds() -> None:
    from bench.level_change import soak_schedule

    schedule = soak_schedule(start=300, every=12, changes=1000, top=4)
    levels = [0] + [level for _, level in schedule]
    assert len(schedule) == 1000 and [s for s, _ in schedule][:2] == [300, 312]
    assert all(abs(b - a) == 1 for a, b in itertools.pairwise(levels))
    assert set(levels) == {0, 1, 2, 3, 4}
    assert soak_schedule(300, 12, 1000, 4) == schedule  # seeded: the same every run


def test_the_soak_report_counts_what_the_acceptance_asks(tmp_path: Path) -> None:
    from bench.level_change import soak_report

    run = {
        "command": "bash bench/gpu/soak.sh qwen3-8b",
        "client": {"completed": 2900, "failed": 0},
        "plugin": {"level_changes": 1004, "resize_failures": 2, "levels_visited": [0, 1, 2, 1]},
    }
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(run))
    report_ = soak_report(str(path))
    assert report_["level_changes"] == 1004 and report_["failed_requests"] == 0
    assert report_["resize_failures"] == 2 and report_["recovered"] == 2
    assert report_["levels_visited"] == [0, 1, 2]
    run["client"]["failed"] = 3
    run["client"]["failures"] = [  # as vLLM's client words them (serve_bench keeps the text)
        {"index": 7, "error": "aiohttp...ServerDisconnectedError: Server disconnected"},
        {"index": 9, "error": "aiohttp.client_exceptions.ClientResponseError: 500"},
        {"index": 11, "kind": "disconnected", "error": ""},
    ]
    path.write_text(json.dumps(run))
    report_ = soak_report(str(path))
    assert report_["recovered"] is None  # not claimed when requests failed
    assert report_["failed_requests"] == 3 and report_["failed_disconnected"] == 2
