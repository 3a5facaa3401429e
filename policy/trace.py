"""JSON-lines trace of the policy: one record per step, one per event (level changes,
failed resizes, aborted drains). Feeds the benchmark plots and the README's main job.

:class:`TraceSummary` is the one reader of that format: the writer feeds it live (for the
shutdown log), :func:`summarize_trace` feeds it a trace file (demo, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from dynoff.policy.status import LiveStatus

try:
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - a declared dependency; only profiling needs it
    _nvtx = None


@contextlib.contextmanager
def trace_range(name: str) -> Iterator[None]:
    """An NVTX range in domain ``dynoff`` (Nsight Systems) that ``torch.profiler`` also
    shows: every prefetch, wait, remap and policy decision runs inside one."""
    with torch.profiler.record_function(name):
        if _nvtx is None:
            yield
        else:
            with _nvtx.annotate(name, domain="dynoff"):
                yield


class TraceSummary:
    """Levels visited, KV capacity at each level, counts of changes and failures."""

    def __init__(self) -> None:
        self.steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.max_waiting = 0
        self.levels_visited: list[int] = [0]
        self.capacity_by_level: dict[int, int] = {}
        self.level_changes = 0
        self.failures = 0
        self.aborted_drains = 0
        self.audit_failures = 0  # changes the change audit (audit_changes) found at fault

    def add(self, record: dict[str, Any]) -> None:
        if record["kind"] == "step":
            self.steps += 1
            if self.first_step is None:
                self.first_step = record["step"]
            self.last_step = record["step"]
            self.max_waiting = max(self.max_waiting, record["waiting"])
            self.capacity_by_level.setdefault(record["level"], record["capacity_blocks"])
        elif record["kind"] != "event":
            return  # per-forward measurements: read by the benchmarks, not summarised here
        elif record["event"] == "level_change":
            self.level_changes += 1
            self.levels_visited.append(record["to_level"])
            self.audit_failures += bool(record.get("audit"))
        elif record["event"] == "resize_failed":
            self.failures += 1
        elif record["event"] == "drain_aborted":
            self.aborted_drains += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "levels_visited": self.levels_visited,
            "capacity_blocks_by_level": dict(sorted(self.capacity_by_level.items())),
            "level_changes": self.level_changes,
            "resize_failures": self.failures,
            "aborted_drains": self.aborted_drains,
            "audit_failures": self.audit_failures,
            "max_waiting": self.max_waiting,
        }


def summarize_records(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The :class:`TraceSummary` of trace records already read."""
    summary = TraceSummary()
    for record in records:
        summary.add(record)
    return summary.as_dict()


def summarize_trace(path: str | Path) -> dict[str, Any]:
    """The :class:`TraceSummary` of a trace file."""
    return summarize_records(json.loads(line) for line in Path(path).read_text().splitlines())


class TraceWriter:
    """Appends records to ``path`` (line-buffered) and keeps a running summary."""

    def __init__(self, path: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as we do
        self.clock = clock  # seconds; each record's "t" counts from the first record
        self._t0: float | None = None
        self.running = TraceSummary()
        self.live = LiveStatus()  # what the status board publishes

    @property
    def enabled(self) -> bool:
        """Records reach a file (else only the running summary sees them)."""
        return self._file is not None

    def step(self, **record: Any) -> None:
        self._write({"kind": "step", **record})

    def forward(self, **record: Any) -> None:
        """What a worker measured for one step's forward (``kind: forward``)."""
        self._write({"kind": "forward", **record})

    def event(self, name: str, **record: Any) -> None:
        self._write({"kind": "event", "event": name, **record})

    def _write(self, record: dict[str, Any]) -> None:
        self.running.add(record)
        self.live.add(record)
        if self._file is not None:
            now = self.clock()
            if self._t0 is None:
                self._t0 = now
            record = {"t": round(now - self._t0, 4), **record}
            self._file.write(json.dumps(record) + "\n")

    def restart_clock(self, clock: Callable[[], float]) -> None:
        """Time records by ``clock`` from now on, from 0 at the next one."""
        self.clock, self._t0 = clock, None

    def summary(self) -> dict[str, Any]:
        return self.running.as_dict()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
