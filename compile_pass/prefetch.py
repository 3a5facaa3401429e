"""The prefetch engine: one async H2D copy per offloaded layer, ordered by CUDA events.

``prefetch(L)`` copies layer L's pinned CPU tensor into its GPU region on a dedicated copy
stream, after the compute stream's queued work (the region's previous occupant) is done;
``wait(L)`` makes the compute stream wait for that copy. On the CPU platform the same code
copies synchronously, so CPU tests exercise the same logic. Each copy and wait is an NVTX
range (domain ``dynoff``) and a ``torch.profiler`` range.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dynoff.policy.trace import trace_range


class PrefetchEngine:
    """Moves layers from pinned host memory into their GPU regions.

    Args:
        sources: layer -> flat ``uint8`` pinned CPU tensor holding the layer's weights.
        destinations: layer -> flat ``uint8`` tensor over the layer's (fixed-address) range.
    """

    def __init__(
        self,
        sources: Mapping[int, torch.Tensor],
        destinations: Mapping[int, torch.Tensor],
        timing: bool = False,
    ) -> None:
        if set(sources) != set(destinations):
            raise ValueError("every offloadable layer needs both a source and a destination")
        for layer in sources:
            if sources[layer].numel() != destinations[layer].numel():
                raise ValueError(f"layer {layer}: source and destination sizes differ")
        self.sources = dict(sources)
        self.destinations = dict(destinations)
        device = next(iter(destinations.values())).device if destinations else torch.device("cpu")
        self.on_cuda = device.type == "cuda"
        self.pending: set[int] = set()
        self.copies = 0
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._region_free = {layer: torch.cuda.Event() for layer in sources}
            self._copied = {layer: torch.cuda.Event() for layer in sources}
        # Optional: (start, end) events around every copy, for the bandwidth benchmark.
        self.timing = timing and self.on_cuda
        self.timings: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def prefetch(self, layer: int) -> None:
        src, dst = self.sources[layer], self.destinations[layer]
        self.copies += 1
        if not self.on_cuda:
            with trace_range(f"dynoff.prefetch.L{layer}"):
                dst.copy_(src)
            return
        # The region's previous occupant must be done with it before the copy lands.
        self._region_free[layer].record(torch.cuda.current_stream())
        self.copy_stream.wait_event(self._region_free[layer])
        with torch.cuda.stream(self.copy_stream), trace_range(f"dynoff.prefetch.L{layer}"):
            if self.timing:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            if self.timing:
                end.record(self.copy_stream)
                self.timings.append((src.numel(), start, end))
        self._copied[layer].record(self.copy_stream)
        self.pending.add(layer)

    def wait(self, layer: int) -> None:
        if layer not in self.pending:
            return
        with trace_range(f"dynoff.wait.L{layer}"):
            torch.cuda.current_stream().wait_event(self._copied[layer])
        self.pending.discard(layer)

    def achieved_bandwidth(self) -> float:
        """Bytes per second over the recorded copies (``timing=True``; synchronizes)."""
        stats = self.transfer_stats(reset=False)
        return stats["bytes"] / stats["seconds"] if stats["seconds"] else 0.0

    def transfer_stats(self, reset: bool = True) -> dict[str, float]:
        """Copies issued, and the bytes and copy-stream seconds of the timed ones
        (``timing=True``); ``reset`` starts a new measurement window."""
        timed_bytes, seconds = 0, 0.0
        if self.timing:
            self.copy_stream.synchronize()
            timed_bytes = sum(n for n, _, _ in self.timings)
            seconds = sum(s.elapsed_time(e) for _, s, e in self.timings) / 1e3
        stats = {"copies": self.copies, "bytes": timed_bytes, "seconds": seconds}
        if reset:
            self.timings.clear()
            self.copies = 0
        return stats

    def synchronize(self) -> None:
        """Finish every copy in flight (before a level change)."""
        if self.on_cuda:
            self.copy_stream.synchronize()
        self.pending.clear()
