"""JSON-lines trace of the policy: one record per step, one per event (level changes,
failed resizes, aborted drains). Feeds the benchmark plots and the README's main job."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class TraceWriter:
    """Appends records to ``path`` (line-buffered) and keeps a running summary."""

    def __init__(self, path: str | None) -> None:
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as we do
        self._t0 = time.monotonic()
        self.levels_visited: list[int] = [0]
        self.capacity_by_level: dict[int, int] = {}
        self.level_changes = 0
        self.failures = 0
        self.aborted_drains = 0

    def step(self, **record: Any) -> None:
        self.capacity_by_level.setdefault(record["level"], record["capacity_blocks"])
        self._write({"kind": "step", **record})

    def event(self, name: str, **record: Any) -> None:
        if name == "level_change":
            self.level_changes += 1
            self.levels_visited.append(record["to_level"])
        elif name == "resize_failed":
            self.failures += 1
        elif name == "drain_aborted":
            self.aborted_drains += 1
        self._write({"kind": "event", "event": name, **record})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            record = {"t": round(time.monotonic() - self._t0, 4), **record}
            self._file.write(json.dumps(record) + "\n")

    def summary(self) -> dict[str, Any]:
        return {
            "levels_visited": self.levels_visited,
            "capacity_blocks_by_level": dict(sorted(self.capacity_by_level.items())),
            "level_changes": self.level_changes,
            "resize_failures": self.failures,
            "aborted_drains": self.aborted_drains,
        }

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
