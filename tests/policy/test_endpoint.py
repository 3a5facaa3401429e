"""The status endpoint's guard and answers on a FastAPI app, with the scheduler's end of the
board played by a real :class:`~dynoff.policy.status.StatusBoard` and the controller's
``operate`` (the server-level test is ``tests/e2e/test_cpu_metrics.py``)."""

from __future__ import annotations

import asyncio
import threading
from argparse import Namespace
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dynoff.policy.endpoint import DynamicOffloadEndpoint
from dynoff.policy.status import StatusBoard, board_dir


def app_for(tmp_path, monkeypatch, dev_mode: bool, enabled: bool = True, api_key=None):
    monkeypatch.setenv("DYNOFF_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1" if dev_mode else "0")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    plugin, app = DynamicOffloadEndpoint(), FastAPI()
    plugin.attach_router(app)
    extra = {"dynamic_offload": {}} if enabled else {}
    engine = SimpleNamespace(vllm_config=SimpleNamespace(additional_config=extra, instance_id="e1"))
    asyncio.run(plugin.init_state(engine, app.state, Namespace(api_key=api_key)))
    return TestClient(app)


STATUS = {"level": 1, "max_level": 3, "changes": {"up": 1, "down": 0}, "control": {"applied": 0}}


def test_the_status_needs_the_plugin_and_a_first_step(tmp_path, monkeypatch) -> None:
    client = app_for(tmp_path, monkeypatch, dev_mode=False, enabled=False)
    reply = client.get("/dynamic_offload/status")
    assert reply.status_code == 404 and "not enabled" in reply.json()["error"]
    client = app_for(tmp_path, monkeypatch, dev_mode=False)
    board = StatusBoard(board_dir("e1"))
    reply = client.get("/dynamic_offload/status")
    assert reply.status_code == 503 and "once it has scheduled a step" in reply.json()["error"]
    board.publish(STATUS)
    reply = client.get("/dynamic_offload/status")
    assert reply.status_code == 200 and reply.json()["level"] == 1
    assert reply.json()["control_route"] == "disabled (set VLLM_SERVER_DEV_MODE=1)"
    # Without dev mode there is no control route, as vLLM has no /sleep without it.
    assert client.post("/dynamic_offload/level", json={"pin": 1}).status_code in (404, 405)


def test_control_is_guarded_by_the_api_key_and_checked(tmp_path, monkeypatch) -> None:
    client = app_for(tmp_path, monkeypatch, dev_mode=True, api_key=["s3cret"])
    board = StatusBoard(board_dir("e1"))
    board.publish(STATUS)
    assert client.post("/dynamic_offload/level", json={"pin": 1}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/dynamic_offload/level", json={"pin": 1}, headers=wrong).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    reply = client.post("/dynamic_offload/level", json={"pin": 4}, headers=auth)
    assert reply.status_code == 400 and reply.json()["error"] == "pin 4 is outside levels 0..3"
    reply = client.post("/dynamic_offload/level", json={"cap": -1}, headers=auth)
    assert (
        reply.status_code == 400
        and reply.json()["error"] == "cap -1 is outside this server's levels 0..3"
    )
    reply = client.post("/dynamic_offload/level", json=[1], headers=auth)
    assert reply.status_code == 400 and "JSON object" in reply.json()["error"]

    # The scheduler's end: it applies the request at its next step and publishes.
    def scheduler() -> None:
        for _ in range(200):
            control = board.poll_control(every_s=0)
            if control is not None:
                board.publish({**STATUS, "pin": control["pin"], "control": {"applied": 1}})
                return
            threading.Event().wait(0.01)

    thread = threading.Thread(target=scheduler)
    thread.start()
    reply = client.post("/dynamic_offload/level", json={"pin": 2, "cap": None}, headers=auth)
    thread.join()
    assert reply.status_code == 200
    assert reply.json()["applied"] and reply.json()["status"]["pin"] == 2


def test_a_request_no_step_applies_is_accepted_not_lost(tmp_path, monkeypatch) -> None:
    client = app_for(tmp_path, monkeypatch, dev_mode=True)
    StatusBoard(board_dir("e1")).publish(STATUS)
    monkeypatch.setattr(DynamicOffloadEndpoint, "APPLY_TIMEOUT_S", 0.2)
    reply = client.post("/dynamic_offload/level", json={"pin": 0})
    assert reply.status_code == 202 and reply.json() == {
        "seq": 1,
        "applied": False,
        "note": "the engine applies it at its next step",
    }


@pytest.mark.parametrize("body", [{"pin": True}, {"pin": 1.5}, {"cap": "3"}])
def test_levels_must_be_integers(tmp_path, monkeypatch, body) -> None:
    client = app_for(tmp_path, monkeypatch, dev_mode=True)
    StatusBoard(board_dir("e1")).publish(STATUS)
    reply = client.post("/dynamic_offload/level", json=body)
    assert reply.status_code == 400 and "must be an integer level or null" in reply.json()["error"]
