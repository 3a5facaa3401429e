"""The plugin's live state, from the scheduler to the API server, and the operator's
controls back.

vLLM runs the scheduler in the engine-core process and ``/metrics`` and the HTTP routes in
the API server process. Its per-step ``SchedulerStats`` cross that boundary field by field
into vLLM's own dataclass: a field vLLM does not declare is dropped on the way, and the one
free-form field, ``kv_connector_stats``, belongs to a KV connector (vLLM's logging stat
logger asserts one is configured when it is set). ``tests/policy/test_status.py`` shows
both. So the scheduler publishes its state on a *status board*: a directory named after
vLLM's ``instance_id`` (the same in both processes, from the one ``VllmConfig``) holding

* ``status.json``, written by the scheduler (atomically, at most every
  :attr:`StatusBoard.interval_s` and at once after a level change or a control), read by
  the stat logger (:mod:`.metrics`) and the status endpoint (:mod:`.endpoint`);
* ``control.json``, written by the endpoint (an operator's pin or cap, numbered), read by
  the scheduler before each step when it changed.

The directory is ``$DYNOFF_STATUS_DIR`` or the system's temporary directory, mode 0700:
only the server's user reads or steers it. It is removed when the scheduler shuts down or
its process exits, and, if the process was killed outright, by the next server's scheduler
(:func:`remove_stale_boards`).

:class:`LiveStatus` keeps the state from the controller's trace records (every step and
every event pass through it, whether or not a trace file is configured).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATUS_DIR_ENV = "DYNOFF_STATUS_DIR"
STATUS_VERSION = 1
STEP_FIELDS = (
    "step",
    "level",
    "target",
    "capacity_blocks",
    "kv_util",
    "waiting",
    "running",
    "decision",
    "proxy",
    "proxy_next",
    "priced_level",
    "margin",
)


def board_dir(instance_id: str) -> Path:
    """The status board of the server whose ``VllmConfig.instance_id`` this is."""
    if not instance_id:
        raise ValueError("the status board needs vLLM's instance_id (VllmConfig.instance_id)")
    base = os.environ.get(STATUS_DIR_ENV) or tempfile.gettempdir()
    return Path(base) / f"vllm-dynoff-{instance_id}"


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, separators=(",", ":")))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or gone with the server
        return None
    return value if isinstance(value, dict) else None


def read_status(directory: Path) -> dict[str, Any] | None:
    """The last state the scheduler published, or None before the first."""
    return _read(directory / "status.json")


def publish_max_level(directory: Path, max_level: int) -> None:
    """Rank 0's worker: the max level the ranks agreed on (:meth:`PolicyConfig.fit_max_level`),
    for the scheduler, which starts after the workers have pinned their host memory and so
    cannot see what they saw."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_atomic(directory / "max_level.json", {"max_level": max_level, "pid": os.getpid()})


def published_max_level(directory: Path) -> int | None:
    """What :func:`publish_max_level` wrote, or None (a worker on another host, or none)."""
    value = (_read(directory / "max_level.json") or {}).get("max_level")
    return value if isinstance(value, int) and value >= 0 else None


def control_error(pin: int | None, cap: int | None, top: int) -> str | None:
    """Why an operator's ``pin``/``cap`` does not fit a server whose plan tops out at level
    ``top``, or None when it fits. The endpoint refuses with it before writing the request
    and the controller checks again when it applies it."""
    if cap is not None and not 0 <= cap <= top:
        return f"cap {cap} is outside this server's levels 0..{top}"
    limit = top if cap is None else cap
    if pin is not None and not 0 <= pin <= limit:
        return f"pin {pin} is outside levels 0..{limit}"
    return None


def write_control(directory: Path, pin: int | None, cap: int | None) -> int:
    """An operator's request: serve at ``pin`` (None: the policy decides) with levels up to
    ``cap`` (None: the plan's maximum). Returns its number, which the status echoes once the
    scheduler has applied it (``control.applied``)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"no status board at {directory}: is the engine running?")
    previous = _read(directory / "control.json") or {}
    seq = int(previous.get("seq", 0)) + 1
    _write_atomic(directory / "control.json", {"seq": seq, "pin": pin, "cap": cap})
    return seq


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_boards(base: Path, max_age_s: float = 86_400.0) -> None:
    """Boards whose scheduler is gone: its process (``pid`` in the status) no longer runs,
    or, never published, older than ``max_age_s``. A server killed outright (SIGKILL) has
    no chance to remove its own."""
    for directory in base.glob("vllm-dynoff-*"):
        status = read_status(directory)
        pid = status.get("pid") if status else None
        try:
            stale = (
                not _alive(pid)
                if isinstance(pid, int)
                else time.time() - directory.stat().st_mtime > max_age_s
            )
        except OSError:
            continue
        if stale:
            shutil.rmtree(directory, ignore_errors=True)


class StatusBoard:
    """The scheduler's end of the board."""

    def __init__(
        self, directory: Path, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self.clock = clock
        remove_stale_boards(directory.parent)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        atexit.register(self.close)  # also when vLLM stops the engine without a shutdown()
        self._published_at: float | None = None
        self._control_mtime: int | None = None
        self._checked_at: float | None = None

    def due(self) -> bool:
        """Whether a periodic publish is due."""
        now = self.clock()
        return self._published_at is None or now - self._published_at >= self.interval_s

    def publish(self, status: dict[str, Any]) -> None:
        payload = {"version": STATUS_VERSION, "pid": os.getpid(), **status}
        _write_atomic(self.directory / "status.json", payload)
        self._published_at = self.clock()

    def poll_control(self, every_s: float = 0.1) -> dict[str, Any] | None:
        """The operator's request if it changed since the last poll (checked at most every
        ``every_s``), else None."""
        now = self.clock()
        if self._checked_at is not None and now - self._checked_at < every_s:
            return None
        self._checked_at = now
        path = self.directory / "control.json"
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return None
        if mtime == self._control_mtime:
            return None
        self._control_mtime = mtime
        return _read(path)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)


class LiveStatus:
    """The controller's state as its trace records tell it: the last step's fields, counts
    of changes (by direction), failed resizes and aborted drains, the stall of each recent
    change (numbered, for the stall histogram), and the recent decisions that moved the
    target or were audited."""

    RECENT = 32

    def __init__(self) -> None:
        self.step: dict[str, Any] = {}
        self.changes = {"up": 0, "down": 0}
        self.resize_failures = 0
        self.drain_aborts = 0
        self.stalls: deque[tuple[int, str, float]] = deque(maxlen=self.RECENT)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.RECENT)
        self.calibration: dict[str, Any] | None = None
        self.draining = 0
        self.dirty = False  # something an operator waits for happened since the last publish

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "step":
            self._step(record)
        elif kind == "event":
            self._event(record)

    def _step(self, record: dict[str, Any]) -> None:
        before = self.step.get("target")
        self.step = {k: record[k] for k in STEP_FIELDS if k in record}
        self.draining = len(record.get("draining") or ())
        reason = record.get("decision")
        if reason not in (None, "hold", "cooldown") and record.get("target") != before:
            self.decisions.append(dict(self.step))

    def _event(self, record: dict[str, Any]) -> None:
        name = record["event"]
        if name == "level_change":
            direction = "up" if record["to_level"] > record["from_level"] else "down"
            self.changes[direction] += 1
            seq = self.changes["up"] + self.changes["down"]
            self.stalls.append((seq, direction, float(record.get("stall_ms") or 0.0)))
            self.dirty = True
        elif name == "resize_failed":
            self.resize_failures += 1
            self.dirty = True
        elif name == "drain_aborted":
            self.drain_aborts += 1
            self.dirty = True
        elif name == "audit":
            self.decisions.append({k: v for k, v in record.items() if k not in ("kind", "t")})
        elif name == "calibration":
            self.calibration = {k: v for k, v in record.items() if k not in ("kind", "event", "t")}

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.step,
            "draining_groups": self.draining,
            "changes": dict(self.changes),
            "resize_failures": self.resize_failures,
            "drain_aborts": self.drain_aborts,
            "stalls": [list(s) for s in self.stalls],
            "decisions": list(self.decisions),
            "calibration": self.calibration,
        }
