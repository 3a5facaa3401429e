"""Run a benchmark or engine script in a subprocess and, when it fails, say why.

vLLM logs to stdout and its engine core reports the root cause of a dead engine there
(``EngineCore encountered an issue. See stack trace (above)``), while the client's
``EngineDeadError`` lands at the end of stderr. Both streams are kept, in order, in one log
file next to the test's outputs, and a failure shows the first error block and the tail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
_ERROR = re.compile(r"^.*(Traceback \(most recent call last\)|\bERROR\b|Error:).*$", re.M)


def failure(log: str, head: int = 5000, tail: int = 2500) -> str:
    """The first error block of ``log`` (from its first traceback or ERROR line) and its
    last ``tail`` characters."""
    first = _ERROR.search(log)
    start = first.start() if first else max(0, len(log) - head - tail)
    shown = log[start : start + head]
    if start + head < len(log) - tail:
        shown += "\n[...]\n" + log[-tail:]
    elif start + head < len(log):
        shown = log[start:]
    return shown


def machine() -> str:
    """What a failure on another machine needs said: cores, CPU model and vector ISA, free
    memory and free disk (vLLM's compile cache and Inductor's kernels are written to it)."""
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    disk = shutil.disk_usage(ROOT).free / 2**30
    tmp = shutil.disk_usage("/tmp").free / 2**30
    return (
        f"machine: {os.cpu_count()} cores, {model}, {' '.join(isa) or 'no avx2'}; "
        f"{mem} memory available; {disk:.1f} GiB free under the repository, {tmp:.1f} GiB in /tmp"
    )


def run_checked(cmd: list[str], log: Path, timeout: int = 900, **kwargs: Any) -> str:
    """Run ``cmd`` from the repository root with stdout and stderr merged into ``log``;
    fail the test with the root cause unless it exits 0. Returns the log's text."""
    with log.open("w") as sink:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, **kwargs
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}; full log {log}\n{machine()}\n" + failure(
        text
    )
    return text
