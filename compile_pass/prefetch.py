"""The prefetch engine: one async H2D copy per offloaded layer, ordered by CUDA events.

``prefetch(L)`` copies layer L's pinned CPU tensor into its GPU region on a dedicated copy
stream, after the compute stream's queued work (the region's previous occupant) is done;
``wait(L)`` makes the compute stream wait for that copy. On the CPU platform the same code
copies synchronously, so CPU tests exercise the same logic. Each copy and wait is an NVTX
range (domain ``dynoff``) and a ``torch.profiler`` range.

The engine also keeps the ledger of what each layer's range shows: its own weights, or its
partner's while the two share a region (``share`` / ``unshare``, from the runtime's level
changes). A ``wait(L)`` with no copy of L pending while L's range shows another layer's
weights raises :class:`WrongWeightsError`: the layer would run on wrong weights, and nothing
else would notice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dynoff.policy.trace import trace_range


class WrongWeightsError(RuntimeError):
    """A layer was about to run on weights that are not its own."""


class PrefetchEngine:
    """Moves layers from pinned host memory into their GPU regions.

    Args:
        sources: layer -> flat ``uint8`` tensor holding the layer's weights in its home
            (:mod:`.homes`: pinned host memory, or device memory in the fast-link emulation).
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
        self.restoring: set[int] = set()  # restore copies (lowering) not yet waited on
        self._restore_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.copies = 0
        self._shows = {layer: layer for layer in destinations}  # whose weights a range holds
        self._partner: dict[int, int] = {}  # layers whose ranges share one region
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._region_free = {layer: torch.cuda.Event() for layer in sources}
            self._copied = {layer: torch.cuda.Event() for layer in sources}
        self.pacer: Any = None  # a :class:`~.homes.Pacer` paces every copy (the emulation)
        # Optional: (start, end) events around every copy, for the bandwidth benchmark.
        self.timing = timing and self.on_cuda
        self.timings: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    @classmethod
    def for_placement(cls, placement: Any, timing: bool = False) -> PrefetchEngine:
        """The engine for a :class:`~dynoff.compile_pass.placement.WeightPlacement`'s
        offloadable layers: each pinned host copy into its layer's range."""
        packs = placement.offloadable()
        return cls(
            {i: p.cpu for i, p in packs.items() if p.cpu is not None},
            {i: p.flat for i, p in packs.items()},
            timing=timing,
        )

    def share(self, resident: int, aliased: int) -> None:
        """``aliased``'s range now maps ``resident``'s pages: both show what it showed."""
        self._shows[aliased] = self._shows[resident]
        self._partner[resident], self._partner[aliased] = aliased, resident
        self.pending.discard(aliased)

    def unshare(self, resident: int, restored: int) -> None:
        """The two ranges have their own pages again, and ``restored`` was copied back."""
        self._partner.pop(resident, None)
        self._partner.pop(restored, None)
        self._shows[restored] = restored

    def holds(self, layer: int) -> int:
        """The layer whose weights ``layer``'s range holds (once queued copies land)."""
        return self._shows[layer]

    def prefetch(self, layer: int) -> None:
        self.copies += 1
        self._shows[layer] = layer
        partner = self._partner.get(layer)
        if partner is not None:  # the copy overwrites the region the partner showed
            self._shows[partner] = layer
            self.pending.discard(partner)
        self._copy_in(layer, "prefetch", timed=self.timing)

    def _copy_in(self, layer: int, what: str, timed: bool = False) -> None:
        """Copy ``layer``'s host bytes into its range: on the CPU at once; on CUDA on the
        copy stream after the compute stream's queued work (the region's previous
        occupant), with its event recorded for ``wait`` and the layer pending."""
        src, dst = self.sources[layer], self.destinations[layer]
        if not self.on_cuda:
            with trace_range(f"dynoff.{what}.L{layer}"):
                dst.copy_(src)
            return
        self._region_free[layer].record(torch.cuda.current_stream())
        self.copy_stream.wait_event(self._region_free[layer])
        with torch.cuda.stream(self.copy_stream), trace_range(f"dynoff.{what}.L{layer}"):
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record(self.copy_stream)
            self.copy_bytes(dst, src)
            if timed:
                end.record(self.copy_stream)
                self.timings.append((src.numel(), start, end))
        self._copied[layer].record(self.copy_stream)
        self.pending.add(layer)

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy from a home into a region, on the current stream: paced when a pacer is
        installed (the device home's emulated link), else one asynchronous copy."""
        if self.pacer is not None:
            self.pacer.copy(dst, src)
        else:
            dst.copy_(src, non_blocking=True)

    def restore(self, layer: int) -> None:
        """Copy ``layer`` back into its own pages after a lowering, on the copy stream: the
        change returns at once, and the step after it waits for the copy only where the
        layer runs (``wait``, which the ops call for a restoring layer at any level; the
        runtime keeps that step off FULL graphs, which would skip the op)."""
        shown, self._shows[layer] = self._shows[layer], layer
        try:
            self._copy_in(layer, "restore")
        except Exception:  # the lowering shares the region again: it shows what it showed
            self._shows[layer] = shown
            raise
        if self.on_cuda:
            self.restoring.add(layer)

    def restore_wait_ms(self) -> float:
        """Device time the compute stream spent waiting for restore copies, over the waits
        that have finished since the last call (non-blocking)."""
        done = [(s, e) for s, e in self._restore_waits if e.query()]
        self._restore_waits = [w for w in self._restore_waits if w not in done]
        return sum(s.elapsed_time(e) for s, e in done)

    def wait(self, layer: int) -> None:
        if layer not in self.pending:
            if self._shows[layer] != layer:
                raise WrongWeightsError(
                    f"layer {layer} would run on layer {self._shows[layer]}'s weights: its "
                    f"shared region holds them and no copy of layer {layer} is pending (the "
                    "pass's prefetch for it is missing or ran out of order)"
                )
            return
        stream = torch.cuda.current_stream()
        restoring = layer in self.restoring
        with trace_range(f"dynoff.wait.L{layer}"):
            if restoring:  # time the device's wait: it is part of the level change's stall
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record(stream)
            stream.wait_event(self._copied[layer])
            if restoring:
                end.record(stream)
                self._restore_waits.append((start, end))
        self.pending.discard(layer)
        self.restoring.discard(layer)

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
        self.restoring.clear()
