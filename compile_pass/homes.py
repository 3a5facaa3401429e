"""Where an offloaded layer's bytes live between its uses: its *home*.

The prefetch engine copies each offloaded layer in from its home before the layer runs, and
a lowering restores the layer from it. Two homes:

* ``"host"`` (the default): pinned host memory, copied over the CPU-GPU link (PCIe Gen5 on
  the H200: ~55 GB/s; NVLink-C2C on a GH200: ~390 GB/s) by the copy engine.
* ``"device"``: GPU memory outside vLLM's budget (beyond ``gpu_memory_utilization``), copied
  device to device by the copy engine. This is an **emulation** of a fast CPU-GPU link on one
  GPU (the fast-link issue): with ``home_GBps`` each copy is paced to that bandwidth by
  splitting it into chunks and spinning the copy stream between them (:class:`Pacer`), so
  the copy engine, not the SMs, moves the bytes, as a DMA link would; the spin occupies one
  SM for its duration. The homes cost HBM the far memory would not: they bound the level
  (two layers a level) by what lies beyond the budget.

A peer GPU's memory over NVLink would be a third home: a device home on another device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

ALIGN = 256  # bytes; chunk boundaries stay aligned for the copy engine
HOME_MARGIN = 2 << 30  # left free beyond the budget (CUDA context growth, other processes)
SPIN_SAMPLE_CYCLES = 2_000_000


class HomeError(ValueError):
    """A home that cannot hold the offloaded layers here, with the fix."""


@dataclasses.dataclass(frozen=True)
class PacePlan:
    """One layer's paced copy: ``chunks`` pieces of ``chunk_bytes``, each followed by a spin
    of ``spin_cycles`` GPU clock cycles."""

    chunk_bytes: int
    chunks: int
    spin_cycles: int

    @property
    def spins(self) -> int:
        """Spin kernels the copy launches (none when it need not wait)."""
        return self.chunks if self.spin_cycles else 0

    @classmethod
    def for_copy(
        cls,
        nbytes: int,
        target_GBps: float,
        raw_GBps: float,
        cycles_per_ns: float,
        chunks: int = 32,
    ) -> PacePlan:
        """Chunks whose copies plus spins take ``nbytes / target_GBps`` in all, given an
        unpaced copy at ``raw_GBps``; no spin when the target is not below the raw speed."""
        if target_GBps <= 0 or raw_GBps <= 0 or cycles_per_ns <= 0:
            raise ValueError("pacing needs positive bandwidths and clock")
        spare_ns = max(0.0, nbytes / target_GBps - nbytes / raw_GBps)  # bytes / (GB/s) = ns
        return cls.spread(nbytes, spare_ns, cycles_per_ns, chunks)

    @classmethod
    def spread(
        cls, nbytes: int, spare_ns: float, cycles_per_ns: float, chunks: int = 32
    ) -> PacePlan:
        """``spare_ns`` of spinning spread evenly after the chunks of an ``nbytes`` copy."""
        chunk = -(-nbytes // chunks)
        chunk = -(-chunk // ALIGN) * ALIGN
        count = -(-nbytes // chunk)
        return cls(chunk, count, math.ceil(max(0.0, spare_ns) / count * cycles_per_ns))


class Pacer:
    """Copies at a target bandwidth on the current stream (CUDA only): chunked copies with
    ``torch.cuda._sleep`` spins between them, planned from a measured unpaced copy and the
    measured clock (:meth:`calibrate`), then held to the target by feedback.

    An open-loop plan is right only on an idle GPU: while a step's kernels fill every SM,
    each spin (a kernel of one thread block) waits for an SM before it starts, and the
    copies fell 27% short of 390 GB/s beside a decode or prefill step on the H100
    (``bench/results/interference_h100.json``), as a slower link would. So each paced copy
    is timed with two CUDA events, and once a copy has finished its duration corrects the
    spin time of the next copies of that size (:meth:`observe`): spinning less when
    the spins were delayed, more when the copies ran fast, never below none. Where even
    unpaced copies cannot reach the target beside the compute, the spin goes to zero and
    :attr:`achieved_GBps` says what the emulated link delivered."""

    GAIN = 0.5  # the share of a copy's timing error corrected at the next copy
    CHUNKS = 32  # a copy's chunks (and spins) to start with
    SPIN_DELAY_SHARE = 0.2  # spins delayed by more than this share of the copy: fewer chunks
    SMOOTHING = 0.1  # weight of the newest copy in :attr:`achieved_GBps`

    def __init__(self, target_GBps: float) -> None:
        if target_GBps <= 0:
            raise ValueError(f"home_GBps={target_GBps} must be > 0")
        self.target_GBps = target_GBps
        self.raw_GBps = 0.0
        self.cycles_per_ns = 0.0
        self.achieved_GBps: float | None = None  # moving average of the timed copies
        self._spare_ns: dict[int, float] = {}  # per copy size: spin time after its chunks
        self._chunks: dict[int, int] = {}  # per copy size: chunks (and spins) a copy takes
        self._plans: dict[int, PacePlan] = {}
        self._timed: collections.deque[tuple[int, float, int, Any, Any]] = collections.deque()

    def calibrate(self, sample: torch.Tensor) -> None:
        """Measure the unpaced device copy of ``sample`` (as the start-up calibration times
        a layer's copy) and the spin's clock."""
        from dynoff.compile_pass.calibrate import link

        scratch = torch.empty_like(sample)
        self.raw_GBps = link({0: sample}, {0: scratch}) / 1e9
        self.cycles_per_ns = spin_clock()
        del scratch

    def plan(self, nbytes: int) -> PacePlan:
        plan = self._plans.get(nbytes)
        if plan is None:
            spare = self._spare_ns.get(nbytes)
            chunks = self._chunks.setdefault(nbytes, self.CHUNKS)
            if spare is None:
                plan = PacePlan.for_copy(
                    nbytes, self.target_GBps, self.raw_GBps, self.cycles_per_ns, chunks
                )
                self._spare_ns[nbytes] = plan.spin_cycles * plan.chunks / self.cycles_per_ns
            else:
                plan = PacePlan.spread(nbytes, spare, self.cycles_per_ns, chunks)
            self._plans[nbytes] = plan
        return plan

    def spare_ns(self, nbytes: int) -> float:
        """The spin time the next copy of ``nbytes`` spreads over its chunks."""
        self.plan(nbytes)
        return self._spare_ns[nbytes]

    def observe(
        self,
        nbytes: int,
        elapsed_ns: float,
        spare_ns: float | None = None,
        spins: int | None = None,
    ) -> None:
        """A paced copy of ``nbytes`` that spun ``spare_ns`` in ``spins`` spins (the plan it
        was issued with; None: the current one) took ``elapsed_ns`` on the device: the next
        copies of that size spin that copy's spin time plus :attr:`GAIN` of its timing
        error. Where the spins waited for SMs longer than :attr:`SPIN_DELAY_SHARE` of the
        copy's target time, the copies take half as many chunks (down to one): behind long
        kernels each spin's wait is what no spin time can take back, and fewer spins wait
        less (the bytes then move in fewer, longer bursts, as the target still bounds).

        Correcting the spin the measured copy used, not the current one, keeps the loop
        stable however many copies are in flight when a measurement lands: a step queues
        two copies per level before the first of them finishes, and an update that summed
        each late measurement's error into the current spin would overshoot by all of them.
        """
        if elapsed_ns <= 0:
            return
        used = self.spare_ns(nbytes) if spare_ns is None else spare_ns
        if spins is None:
            spins = self.plan(nbytes).spins
        target_ns = nbytes / self.target_GBps
        waited_ns = elapsed_ns - nbytes / self.raw_GBps - used  # the spins' waits for SMs
        chunks = self._chunks[nbytes]
        if spins > 1 and waited_ns > self.SPIN_DELAY_SHARE * target_ns:
            # Half the measured copy's spins, not the current count's: late measurements of
            # copies still planned with more chunks must not halve it again and again.
            self._chunks[nbytes] = min(chunks, spins // 2)
        self._spare_ns[nbytes] = max(0.0, used + self.GAIN * (target_ns - elapsed_ns))
        self._plans.pop(nbytes, None)
        achieved = nbytes / elapsed_ns
        old = self.achieved_GBps
        self.achieved_GBps = achieved if old is None else old + self.SMOOTHING * (achieved - old)

    def _settle(self) -> None:
        """Feed back every timed copy that has finished (non-blocking, in order)."""
        while self._timed and self._timed[0][4].query():
            nbytes, used, spins, start, end = self._timed.popleft()
            self.observe(nbytes, start.elapsed_time(end) * 1e6, used, spins)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._settle()
        nbytes = src.numel()
        plan = self.plan(nbytes)
        used = self._spare_ns[nbytes]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for offset in range(0, nbytes, plan.chunk_bytes):
            stop = min(nbytes, offset + plan.chunk_bytes)
            dst[offset:stop].copy_(src[offset:stop], non_blocking=True)
            if plan.spin_cycles:
                torch.cuda._sleep(plan.spin_cycles)
        end.record()
        self._timed.append((nbytes, used, plan.spins, start, end))

    def describe(self) -> str:
        return (
            f"paced to {self.target_GBps:.0f} GB/s (unpaced device copy {self.raw_GBps:.0f} "
            f"GB/s, clock {self.cycles_per_ns:.2f} cycles/ns; held there by feedback)"
        )


def spin_clock(repeats: int = 3) -> float:
    """GPU clock cycles per nanosecond as ``torch.cuda._sleep`` counts them. The spin kernel
    is loaded first (its first launch loads the module, host time that would land between
    the events), and each timed spin is queued behind another, so the host's launch latency
    stays outside the events too; the shortest of ``repeats`` is the least inflated. A clock
    read too slow makes every spin too short and the paced copies too fast."""
    torch.cuda._sleep(1_000)
    torch.cuda.synchronize()
    best_ms = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_SAMPLE_CYCLES // 4)  # busy while the timed spin is queued
        start.record()
        torch.cuda._sleep(SPIN_SAMPLE_CYCLES)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    return SPIN_SAMPLE_CYCLES / (best_ms * 1e6)


def check_device_home(max_level: int, layer_bytes: int, beyond_budget: int) -> None:
    """Refuse a device home that does not fit beyond vLLM's budget: two layers a level."""
    needed = 2 * max_level * layer_bytes
    if needed > beyond_budget:
        fits = beyond_budget // (2 * layer_bytes) if layer_bytes else 0
        raise HomeError(
            f'home "device" needs {needed / 2**30:.1f} GiB beyond gpu_memory_utilization for '
            f"max_level={max_level} (two layers of {layer_bytes / 2**30:.2f} GiB a level) but "
            f'{beyond_budget / 2**30:.1f} GiB is there: set "policy": {{"max_level": {fits}}}, '
            "or lower --gpu-memory-utilization"
        )


def move_homes_to_device(
    sources: dict[int, torch.Tensor], device: Any, packs: Mapping[int, Any]
) -> int:
    """Replace every layer's pinned host copy by a device copy (in place in ``sources`` and
    on the packs); the host memory is unpinned and freed with its last reference
    (:func:`~dynoff.compile_pass.placement.pinned_empty`). Returns the bytes moved."""
    moved = 0
    for layer, host in list(sources.items()):
        home = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        home.copy_(host)
        sources[layer] = home
        packs[layer].cpu = home
        moved += host.numel()
    torch.cuda.synchronize(device)
    return moved
