"""Forward time per step without stalling the GPU: CUDA events, read once they complete.

A step's time becomes known only when its end event has completed, so a report carries the
latest *finished* step (usually the previous one under async scheduling); the policy's
averages do not mind the lag. On the CPU the host clock is exact and immediate.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch


@dataclasses.dataclass
class Timed:
    step: int
    level: int
    decode_tokens: int
    prefill_tokens: int
    context_tokens: int = 0
    forward_ms: float = 0.0
    prefill_pairs: int = 0


class StepTimer:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._open: tuple[Timed, object] | None = None
        self._pending: collections.deque[tuple[Timed, object, object]] = collections.deque()

    def start(self, info: Timed) -> None:
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._open = (info, begin)
        else:
            self._open = (info, time.perf_counter())

    def stop(self) -> None:
        if self._open is None:
            return
        info, begin = self._open
        self._open = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((info, begin, end))
        else:
            info.forward_ms = (time.perf_counter() - begin) * 1e3  # type: ignore[operator]
            self._pending.append((info, None, None))

    def latest_finished(self) -> Timed | None:
        """The most recent step whose forward has finished (others finished are dropped)."""
        latest = None
        while self._pending:
            info, begin, end = self._pending[0]
            if end is not None:
                if not end.query():  # type: ignore[attr-defined]
                    break
                info.forward_ms = begin.elapsed_time(end)  # type: ignore[attr-defined]
            latest = info
            self._pending.popleft()
        return latest
