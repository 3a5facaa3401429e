"""A write into the read-only zero page must fault, not silently corrupt the page every
unmapped address reads. Run in a subprocess, since the fault kills the process (host: SIGSEGV)
or the CUDA context (cuda: an illegal-address error)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from dynoff.allocator import VmmArena
    arena = VmmArena({backend!r})
    r = arena.reserve(1)
    view = r.tensor(torch.float32, (16,))
    assert float(view.sum()) == 0.0
    print("READ-OK", flush=True)
    view.fill_(1.0)
    if {backend!r} == "cuda":
        torch.cuda.synchronize()
    print("WROTE", flush=True)
    """
)


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_into_zero_page_faults(backend: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(backend=backend)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "READ-OK" in proc.stdout, proc.stderr
    assert "WROTE" not in proc.stdout
    if backend == "host":
        assert proc.returncode == -signal.SIGSEGV
    else:
        assert proc.returncode != 0
        assert "illegal" in proc.stderr.lower() or "cuda error" in proc.stderr.lower()
