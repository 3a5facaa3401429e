"""The status endpoint: an endpoint plugin (``vllm.endpoint_plugins``) on ``vllm serve``.

* ``GET /dynamic_offload/status``: the policy's state as the scheduler last published it
  (:mod:`.status`): the level and its target, KV capacity, C_k and L_k at every level as
  the policy prices them, the start-up calibration, the counts of changes, failures and
  aborted drains, the stall of the recent changes, and the recent decisions with their
  reasons.
* ``POST /dynamic_offload/level`` with ``{"pin": k | null, "cap": m | null}``: serve at
  level k (null: the policy decides) with no level above m (null: the plan's maximum).
  It answers once the scheduler has applied the request (or with 202 if no step ran within
  :attr:`DynamicOffloadEndpoint.APPLY_TIMEOUT_S`: the engine applies it at its next step).

Guarded as vLLM guards its own admin routes: vLLM loads endpoint plugins only when
``VLLM_PLUGINS`` names them (``VLLM_PLUGINS=dynamic_offload`` names this one, the general
plugin and the stat logger), the control route exists only with ``VLLM_SERVER_DEV_MODE=1``
(like ``/sleep`` and ``/reset_prefix_cache``), and with ``--api-key`` it also needs that
bearer token.
"""

from __future__ import annotations

import asyncio
import os
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State
from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware

from dynoff.policy.status import board_dir, control_error, read_status, write_control

STATE_ATTR = "dynamic_offload_board"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def _dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").lower() in ("1", "true")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _authorized(request: Request) -> bool:
    """vLLM's own bearer-token check (its ``AuthenticationMiddleware`` guards only the
    ``/v1`` routes): the keys ``--api-key`` or ``VLLM_API_KEY`` gave the server."""
    keys = getattr(request.app.state, "dynamic_offload_keys", [])
    return not keys or AuthenticationMiddleware(request.app, keys).verify_token(request.headers)


def _board(request: Request) -> Path | None:
    return getattr(request.app.state, STATE_ATTR, None)


async def get_status(request: Request) -> JSONResponse:
    directory = _board(request)
    if directory is None:
        return _error(404, "dynamic offloading is not enabled on this server")
    status = read_status(directory)
    if status is None:
        return _error(503, "no status yet: the engine publishes it once it has scheduled a step")
    status["control_route"] = "enabled" if _dev_mode() else f"disabled (set {DEV_MODE_ENV}=1)"
    return JSONResponse(status)


def _level_arg(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer level or null, got {value!r}")
    return value


async def set_level(request: Request) -> JSONResponse:
    directory = _board(request)
    if directory is None:
        return _error(404, "dynamic offloading is not enabled on this server")
    if not _authorized(request):
        return _error(401, "Unauthorized")
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        pin, cap = _level_arg(body, "pin"), _level_arg(body, "cap")
    except ValueError as e:
        return _error(400, f'{e}; send {{"pin": k or null, "cap": m or null}}')
    status = read_status(directory)
    if status is not None:  # refused here with the fix; the scheduler checks again
        error = control_error(pin, cap, status["max_level"])
        if error is not None:
            return _error(400, error)
    try:
        seq = write_control(directory, pin, cap)
    except FileNotFoundError as e:
        return _error(503, str(e))
    deadline = asyncio.get_running_loop().time() + DynamicOffloadEndpoint.APPLY_TIMEOUT_S
    while asyncio.get_running_loop().time() < deadline:
        status = read_status(directory)
        control = (status or {}).get("control") or {}
        if control.get("applied", 0) >= seq:
            if control.get("error"):
                return _error(400, control["error"])
            return JSONResponse({"seq": seq, "applied": True, "status": status})
        await asyncio.sleep(0.05)
    return JSONResponse(
        {"seq": seq, "applied": False, "note": "the engine applies it at its next step"},
        status_code=202,
    )


class DynamicOffloadEndpoint:
    """The ``vllm.endpoint_plugins`` entry point (vLLM's ``EndpointPlugin`` protocol)."""

    name = "dynamic_offload"
    required_tasks = ("generate",)
    APPLY_TIMEOUT_S = 5.0

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route("/dynamic_offload/status", get_status, methods=["GET"])
        if _dev_mode():
            router.add_api_route("/dynamic_offload/level", set_level, methods=["POST"])
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        config = getattr(engine_client, "vllm_config", None)
        extra = getattr(config, "additional_config", None)
        if config is None or not isinstance(extra, dict) or "dynamic_offload" not in extra:
            return  # not enabled: the routes answer 404 with the reason
        setattr(state, STATE_ATTR, board_dir(config.instance_id))
        # As vLLM resolves its own: --api-key, else VLLM_API_KEY.
        keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")]
        state.dynamic_offload_keys = [k for k in keys if k]
