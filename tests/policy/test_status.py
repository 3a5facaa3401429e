"""The status board between the scheduler and the API server, the operator's controls, and
the Prometheus metrics the stat-logger plugin sets from it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from prometheus_client import REGISTRY

from dynoff.policy.metrics import DynamicOffloadStatLogger
from dynoff.policy.status import LiveStatus, StatusBoard, board_dir, read_status, write_control
from tests.policy.test_controller import ack, controller


def test_scheduler_stats_cannot_carry_the_plugins_state() -> None:
    """Why the board exists: vLLM decodes ``SchedulerStats`` into its own dataclass on the
    API server's side, so a field it does not declare is lost on the way."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    @dataclasses.dataclass
    class WithOffload(SchedulerStats):
        dynamic_offload: dict | None = None

    sent = EngineCoreOutputs(
        engine_index=0, outputs=[], scheduler_stats=WithOffload(3, dynamic_offload={"level": 2})
    )
    got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent))
    assert got.scheduler_stats.num_running_reqs == 3
    assert not hasattr(got.scheduler_stats, "dynamic_offload")


def test_the_board_is_private_to_the_server_and_named_after_its_instance(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("DYNOFF_STATUS_DIR", str(tmp_path))
    directory = board_dir("ab12c")
    assert directory == tmp_path / "vllm-dynoff-ab12c"
    with pytest.raises(ValueError, match="instance_id"):
        board_dir("")
    with pytest.raises(FileNotFoundError, match="is the engine running"):
        write_control(directory, 1, None)
    board = StatusBoard(directory)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert read_status(directory) is None
    board.publish({"level": 1})
    assert read_status(directory) == {"version": 1, "pid": os.getpid(), "level": 1}
    board.close()
    assert not directory.exists()


def test_a_board_whose_scheduler_is_gone_is_removed_by_the_next(tmp_path, monkeypatch) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("DYNOFF_STATUS_DIR", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead = StatusBoard(board_dir("dead1"))
    dead.publish({"level": 0})
    status = json.loads((dead.directory / "status.json").read_text())
    status["pid"] = int(gone.stdout)  # a process that has exited
    (dead.directory / "status.json").write_text(json.dumps(status))
    live = StatusBoard(board_dir("live1"))
    live.publish({"level": 0})
    StatusBoard(board_dir("new01"))
    assert not dead.directory.exists()  # its scheduler is gone
    assert live.directory.exists()  # this process still runs


def test_a_control_request_is_read_once_and_numbered(tmp_path) -> None:
    clock = [0.0]
    board = StatusBoard(tmp_path / "b", clock=lambda: clock[0])
    assert board.poll_control() is None
    assert write_control(board.directory, 2, None) == 1
    clock[0] += 1
    assert board.poll_control() == {"seq": 1, "pin": 2, "cap": None}
    clock[0] += 1
    assert board.poll_control() is None  # unchanged since
    assert write_control(board.directory, None, 1) == 2
    assert board.poll_control() is None  # polled 0 s ago: not yet
    clock[0] += 1
    assert board.poll_control() == {"seq": 2, "pin": None, "cap": 1}


def test_publishing_is_periodic() -> None:
    clock = [0.0]
    board = StatusBoard.__new__(StatusBoard)
    board.interval_s, board.clock, board._published_at = 0.5, (lambda: clock[0]), None
    assert board.due()
    board._published_at = 0.0
    clock[0] = 0.4
    assert not board.due()
    clock[0] = 0.5
    assert board.due()


def test_the_live_status_follows_the_trace_records() -> None:
    live = LiveStatus()
    live.add({"kind": "step", "step": 1, "level": 0, "target": 0, "decision": "hold"})
    live.add({"kind": "step", "step": 2, "level": 0, "target": 2, "decision": "up", "proxy": 1.0})
    live.add(
        {"kind": "event", "event": "level_change", "from_level": 0, "to_level": 1, "stall_ms": 4}
    )
    live.add(
        {"kind": "event", "event": "level_change", "from_level": 1, "to_level": 2, "stall_ms": 5}
    )
    live.add({"kind": "event", "event": "resize_failed", "step": 9})
    live.add(
        {"kind": "event", "event": "level_change", "from_level": 2, "to_level": 1, "stall_ms": 6}
    )
    live.add({"kind": "step", "step": 3, "level": 1, "target": 1, "draining": [4, 5]})
    status = live.as_dict()
    assert status["changes"] == {"up": 2, "down": 1} and status["resize_failures"] == 1
    assert status["stalls"] == [[1, "up", 4.0], [2, "up", 5.0], [3, "down", 6.0]]
    assert [d["step"] for d in status["decisions"]] == [2]  # the one that moved the target
    assert status["level"] == 1 and status["draining_groups"] == 2 and live.dirty


def test_an_operator_pins_and_caps_the_level(tmp_path) -> None:
    ctl, _ = controller(tmp_path, max_level=2)
    ctl.operate(1, pin=2, cap=None)
    command = ctl.on_schedule_start(1, waiting=0, running=0)
    assert command is not None and command.target_level == 1  # one level per command
    ctl.on_report(ack(command, level=1))
    command = ctl.on_schedule_start(2, 0, 0)
    assert command is not None and command.target_level == 2
    ctl.on_report(ack(command, level=2))
    status = ctl.status(block_size=16)
    assert (status["level"], status["pin"], status["decision"]) == (2, 2, "pinned")
    assert status["changes"] == {"up": 2, "down": 0}
    assert status["capacity_tokens"] == status["capacity_blocks"] * 16
    assert [row["level"] for row in status["levels"]] == [0, 1, 2]
    # A cap below the level: the policy decides again, within it; the tier drains (held).
    ctl.operate(2, pin=None, cap=1)
    assert ctl.policy.max_level == 1 and ctl.policy.level == 1
    for step in range(3, 12):
        command = ctl.on_schedule_start(step, 0, 0)
        if command is not None:
            ctl.on_report(ack(command, level=command.target_level))
    assert ctl.level <= 1
    # Out of range: refused with the reason, nothing changes.
    ctl.operate(3, pin=2, cap=1)  # every request sets both: pin and cap
    assert ctl.control_error == "pin 2 is outside levels 0..1"
    ctl.operate(4, pin=None, cap=5)
    status = ctl.status(16)
    assert status["control"] == {
        "applied": 4,
        "error": "cap 5 is outside this server's levels 0..2",
    }
    assert status["cap"] == 1 and ctl.policy.max_level == 1


def test_the_stat_logger_sets_vllms_style_metrics_from_the_board(tmp_path, monkeypatch) -> None:
    from vllm.config import VllmConfig

    monkeypatch.setenv("DYNOFF_STATUS_DIR", str(tmp_path))
    config = VllmConfig(additional_config={"dynamic_offload": {}})
    config.instance_id = "t0001"
    stat_logger = DynamicOffloadStatLogger(config, engine_index=0)
    board = StatusBoard(board_dir("t0001"))
    labels = {"model_name": stat_logger._labels["model_name"], "engine": "0"}

    def value(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, **extra})

    status = {
        "level": 1,
        "target": 2,
        "max_level": 4,
        "cap": None,
        "capacity_blocks": 100,
        "capacity_tokens": 1600,
        "draining_groups": 0,
        "blocks_being_stored": None,
        "decision": "up",
        "changes": {"up": 1, "down": 0},
        "resize_failures": 0,
        "drain_aborts": 0,
        "stalls": [[1, "up", 4.0]],
    }
    board.publish(status)
    stat_logger.record(None, None)
    assert value("vllm:dynoff_offload_level") == 1
    assert value("vllm:dynoff_offload_target_level") == 2
    assert value("vllm:dynoff_kv_capacity_tokens") == 1600
    assert value("vllm:dynoff_level_changes_total", direction="up") == 1
    assert value("vllm:dynoff_policy_decision", reason="up") == 1
    assert value("vllm:dynoff_policy_decision", reason="hold") == 0
    assert value("vllm:dynoff_level_change_stall_seconds_count", direction="up") == 1
    assert value("vllm:dynoff_kv_blocks_being_stored") is None  # no CPU KV tier: not set
    # The next change, read once the logger's read interval has passed.
    status.update(level=2, changes={"up": 2, "down": 0}, stalls=[[1, "up", 4.0], [2, "up", 5.0]])
    status.update(blocks_being_stored=30)
    board.publish(status)
    stat_logger.record(None, None)
    assert value("vllm:dynoff_offload_level") == 1  # read 0 s ago: not yet
    stat_logger._read_at = None
    stat_logger.record(None, None)
    assert value("vllm:dynoff_offload_level") == 2
    assert value("vllm:dynoff_level_changes_total", direction="up") == 2
    assert value("vllm:dynoff_kv_blocks_being_stored") == 30
    assert value("vllm:dynoff_level_change_stall_seconds_count", direction="up") == 2
    assert value("vllm:dynoff_level_change_stall_seconds_sum", direction="up") == pytest.approx(
        9e-3
    )
    board.close()


def test_the_stat_logger_does_nothing_without_dynamic_offloading(tmp_path) -> None:
    from vllm.config import VllmConfig

    stat_logger = DynamicOffloadStatLogger(VllmConfig(), engine_index=0)
    assert not stat_logger.enabled
    stat_logger.record(None, None)  # no board, no metrics, no error


def test_the_trace_file_and_the_board_agree(tmp_path) -> None:
    ctl, _ = controller(tmp_path, schedule=[(1, 1)])
    ctl.on_report(ack(ctl.on_schedule_start(1, 0, 0), level=1))  # type: ignore[arg-type]
    ctl.on_schedule_start(2, 0, 0)
    ctl.trace.close()
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    changes = [r for r in records if r.get("event") == "level_change"]
    assert ctl.status(16)["changes"]["up"] == len(changes) == 1
