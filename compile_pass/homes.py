"""Where an offloaded layer's bytes live between its uses: its *home*.

The prefetch engine copies each offloaded layer in from its home before the layer runs, and
a lowering restores the layer from it. Two homes:

* ``"host"`` (the default): pinned host memory, copied over the CPU-GPU link (PCIe Gen5 on
  the H200: ~55 GB/s; NVLink-C2C on a GH200: ~390 GB/s) by the copy engine.
* ``"device"``: GPU memory outside vLLM's budget (beyond ``gpu_memory_utilization``), copied
  device to device. This is an **emulation** of a fast CPU-GPU link on one GPU (the
  fast-link issue): with ``home_GBps`` each copy is paced to that bandwidth by a copy kernel
  on a few SMs that waits for each block's deadline on the GPU's clock (:class:`Pacer`),
  where a DMA link would use no SM; it reads the home and writes the region, two bytes of
  HBM traffic per byte moved where a host link writes one. The homes cost HBM the far
  memory would not: they bound the level (two layers a level) by what lies beyond the
  budget.

A peer GPU's memory over NVLink would be a third home: a device home on another device.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger("vllm.dynoff.homes")

HOME_MARGIN = 2 << 30  # left free beyond the budget (CUDA context growth, other processes)


class HomeError(ValueError):
    """A home that cannot hold the offloaded layers here, with the fix."""


WORD = 8  # bytes the paced copy kernel moves per element (int64 words)
BLOCK_WORDS = 8192  # words a program claims at a time: 64 KiB, in flight at once
WARPS = 8  # a program's warps: 32 words (256 bytes) a thread
PROGRAM_LADDER = (4, 8, 16, 32, 64)  # copy programs (CTAs) tried at calibration
HEADROOM = 1.5  # the unpaced kernel must reach this multiple of the target


def block_ps(target_GBps: float, block_words: int = BLOCK_WORDS) -> int:
    """Picoseconds between the deadlines of consecutive blocks at ``target_GBps``: block b of
    a copy may start ``b * block_ps`` after the copy's first program started, so the bytes
    move at the target on average however the programs are delayed. Bytes / (GB/s) = ns."""
    if target_GBps <= 0:
        raise ValueError(f"home_GBps={target_GBps} must be > 0")
    return round(block_words * WORD * 1000 / target_GBps)


def enough_programs(rates: Mapping[int, float], target_GBps: float) -> int:
    """The fewest programs whose unpaced copy reached :data:`HEADROOM` times the target
    (``rates``: GB/s measured per program count), else the fastest count measured."""
    for programs in sorted(rates):
        if rates[programs] >= HEADROOM * target_GBps:
            return programs
    return max(rates, key=lambda p: rates[p])


@functools.cache
def paced_copy_kernel() -> Any:
    """The Triton kernel (compiled on first use, CUDA only): programs claim 64 KiB blocks of
    the copy in order from a counter, and block b waits until ``b * block_ps`` after the
    first program started, read from the GPU's nanosecond ``%globaltimer``. A program keeps a
    whole block in flight (64 KiB), so that few programs reach the target. The pace is not
    specialized on: Triton compiles a kernel per divisibility of an integer argument, and a
    pace not divisible by 16 (390 GB/s: 168,041 ps a block) would compile a second kernel,
    seconds long, inside the first paced copy, where calibration's unpaced 0 had compiled
    the first (the kernel's first H100 run held 200 GB/s, whose pace divides by 16, and fell
    short at 390 on an idle GPU). One launch per copy, each program resident on an SM for
    the copy's duration (a bounded number of CTAs): a spin kernel between chunks instead
    would wait for an SM behind every kernel of a busy step, and the copies fell short of or
    overshot the target by 30-80% beside a prefill on the H100 (2026-12-06). Whole blocks
    are copied unmasked: the mask kept every access to 8 bytes (a thread's 32 words, 32
    loads and 32 stores; 226 registers a thread for sm_90a), where whole blocks take 16-byte
    accesses (16 each; 180 registers)."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    @triton.jit(do_not_specialize=["block_ps"])  # one compiled kernel for every pace
    def paced_copy(src, dst, n_words, block_ps, state, BLOCK: tl.constexpr):
        now = globaltimer()
        first = tl.atomic_cas(state, now * 0, now)  # state[0]: the first program's start
        start = tl.where(first == 0, now, first)
        n_blocks = tl.cdiv(n_words, BLOCK)
        offsets = tl.arange(0, BLOCK)
        block = tl.atomic_add(state + 1, 1)  # state[1]: the next block to claim
        while block < n_blocks:
            due = start + block * block_ps // 1000
            now = globaltimer()
            while now < due:
                now = globaltimer()
            first_word = block * BLOCK
            if first_word + BLOCK <= n_words:  # a whole block: 16-byte accesses, no mask
                data = tl.load(src + first_word + offsets, cache_modifier=".cg")
                tl.store(dst + first_word + offsets, data, eviction_policy="evict_first")
            else:  # the copy's tail
                inside = offsets < n_words - first_word
                data = tl.load(src + first_word + offsets, mask=inside, cache_modifier=".cg")
                tl.store(
                    dst + first_word + offsets, data, mask=inside, eviction_policy="evict_first"
                )
            block = tl.atomic_add(state + 1, 1)

    return paced_copy


class Pacer:
    """Copies at a target bandwidth on the current stream (CUDA only), with one launch of
    :func:`paced_copy_kernel` per copy on a bounded number of programs, the fewest that
    reach :data:`HEADROOM` times the target unpaced (:meth:`calibrate`). The deadlines are
    absolute from the copy's start, so a program delayed behind a step's kernels catches up
    with what the others left, and the copy keeps its schedule on average.

    What the schedule cannot see is the time a copy takes beyond it: the kernel's launch from
    the host and its wait for a first SM, and blocks that could not keep their deadlines
    beside a busy step. On the H100 (2026-12-06) copies of a Qwen3-8B-sized layer scheduled
    for 1.25 ms (390 GB/s) took about 1.5 ms beside a prefill (323 GB/s). So each copy is
    timed with two CUDA events, the time it took beyond its schedule (its *lag*) is kept
    per copy size, and the next copies are scheduled faster by what makes schedule plus lag
    take ``nbytes / target``, up to unpaced. The lag does not depend on the schedule it was
    measured under, so measurements that land late (a step queues two copies a level before
    the first ends) cannot make the loop overshoot. It is the median of the last
    :data:`LAG_WINDOW` copies of a size, and none before :data:`LAG_MIN` have been timed:
    one copy's one-off cost (its stream's first counters allocated, its first launch there)
    would otherwise speed up the copies after it past the target (the H100's idle test at
    390 GB/s reached 478, 2026-12-06, over six copies). :attr:`achieved_GBps` is the moving
    average of what the copies reached, the emulated link's figure in the serving report.

    Making up lag needs programs that can outrun the target beside the step. Calibration
    picks them on an idle GPU; beside a prefill's GEMMs the same programs get fewer SM
    slots, and copies running unpaced still fell short: 348 GB/s at a 390 target on two of
    three H100s (2026-12-06). After :data:`WIDEN_AFTER` unpaced copies in a row short of
    the target, the pacer moves to the next program count calibration measured, and keeps
    it (a link's bandwidth is the emulation's figure; the SMs it occupies are reported by
    :meth:`describe` and ``bench.interference``)."""

    LAG_WINDOW = 5  # copies of a size whose median lag schedules the next one
    LAG_MIN = 3  # copies of a size timed before their lag is made up
    WIDEN_AFTER = 3  # unpaced copies in a row short of the target before more programs
    SMOOTHING = 0.1  # weight of the newest copy in :attr:`achieved_GBps`
    HISTORY = 64  # recent copies kept for a report: (bytes, scheduled GB/s, elapsed ns)

    def __init__(
        self, target_GBps: float, block_words: int = BLOCK_WORDS, warps: int = WARPS
    ) -> None:
        block_ps(target_GBps)  # checks the target
        self.target_GBps = target_GBps
        # A program's shape: the words it claims and keeps in flight at a time, its warps.
        # Wider programs need fewer of them for a rate, so fewer SMs (bench.interference).
        self.block_words, self.warps = block_words, warps
        self.raw_GBps = 0.0  # the unpaced kernel's copy at :attr:`programs`
        self.programs = PROGRAM_LADDER[-1]
        self.rates: dict[int, float] = {}  # calibration: unpaced GB/s per program count
        self._short = 0  # unpaced copies in a row that fell short of the target
        self.achieved_GBps: float | None = None  # moving average of the timed copies
        # per copy size: the time the last copies took beyond their schedule
        self._lags_ns: dict[int, collections.deque[float]] = {}
        self.history: collections.deque[tuple[int, float, float]] = collections.deque(
            maxlen=self.HISTORY
        )
        self._state: dict[int, torch.Tensor] = {}  # per stream: (start, next block)
        # launched copies not yet accounted: (bytes, scheduled GB/s, programs, start, end)
        self._timed: collections.deque[tuple[int, float, int, Any, Any]] = collections.deque()

    def calibrate(self, sample: torch.Tensor) -> None:
        """Time the kernel unpaced over ``sample`` at each count of :data:`PROGRAM_LADDER`
        (up to the GPU's SMs) and keep the fewest programs with :data:`HEADROOM`."""
        scratch = torch.empty_like(sample)
        sms = torch.cuda.get_device_properties(sample.device).multi_processor_count
        rates: dict[int, float] = {}
        for programs in (p for p in PROGRAM_LADDER if p <= sms):
            self._launch(scratch, sample, programs, 0)  # warm-up (and the compile)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                self._launch(scratch, sample, programs, 0)
            end.record()
            end.synchronize()
            rates[programs] = 3 * sample.numel() / (start.elapsed_time(end) * 1e6)
        del scratch
        self.rates = rates
        self.programs = enough_programs(rates, self.target_GBps)
        self.raw_GBps = rates[self.programs]

    def schedule_GBps(self, nbytes: int) -> float:
        """The rate the next copy of ``nbytes`` is scheduled at: faster than the target by
        what its measured lag needs, ``math.inf`` (unpaced) where no schedule leaves room."""
        room_ns = nbytes / self.target_GBps - self.lag_ns(nbytes)
        if room_ns <= 0:
            return math.inf
        rate = nbytes / room_ns
        return math.inf if self.raw_GBps and rate >= self.raw_GBps else rate

    def lag_ns(self, nbytes: int) -> float:
        """The lag the next copy of ``nbytes`` makes up: the median of the last copies', 0
        before :data:`LAG_MIN` were timed."""
        lags = self._lags_ns.get(nbytes, ())
        return statistics.median(lags) if len(lags) >= self.LAG_MIN else 0.0

    def observe(
        self,
        nbytes: int,
        elapsed_ns: float,
        scheduled_GBps: float | None = None,
        programs: int | None = None,
    ) -> None:
        """A copy of ``nbytes`` scheduled at ``scheduled_GBps`` (None: the current schedule)
        on ``programs`` (None: the current count) took ``elapsed_ns`` on the device. A copy
        launched before the pacer widened counts in :attr:`achieved_GBps` only: its lag, and
        its shortfall, are the narrower kernel's (measurements land up to a level's copies
        late)."""
        if elapsed_ns <= 0:
            return
        if scheduled_GBps is None:
            scheduled_GBps = self.schedule_GBps(nbytes)
        achieved = nbytes / elapsed_ns
        old = self.achieved_GBps
        self.achieved_GBps = achieved if old is None else old + self.SMOOTHING * (achieved - old)
        if programs is not None and programs != self.programs:
            if math.isinf(scheduled_GBps):
                scheduled_GBps = self.rates.get(programs, math.inf)
            self.history.append((nbytes, scheduled_GBps, elapsed_ns))
            return
        unpaced = math.isinf(scheduled_GBps)
        if unpaced:
            scheduled_GBps = self.raw_GBps or math.inf
        lag = max(0.0, elapsed_ns - nbytes / scheduled_GBps)
        self._lags_ns.setdefault(nbytes, collections.deque(maxlen=self.LAG_WINDOW)).append(lag)
        self.history.append((nbytes, scheduled_GBps, elapsed_ns))
        self._short = self._short + 1 if unpaced and achieved < self.target_GBps else 0
        if self._short >= self.WIDEN_AFTER:
            self._widen()

    def _widen(self) -> None:
        """The next program count calibration measured, if any; the lags measured on fewer
        programs are dropped (they would keep the copies unpaced)."""
        self._short = 0
        wider = sorted(p for p in self.rates if p > self.programs)
        if wider:
            logger.info(
                "dynamic offload: paced copies fell short of %.0f GB/s unpaced (%.0f GB/s "
                "reached); copy programs %d -> %d",
                self.target_GBps,
                self.achieved_GBps or 0.0,
                self.programs,
                wider[0],
            )
            self.programs = wider[0]
            self.raw_GBps = self.rates[self.programs]
            self._lags_ns.clear()

    def _launch(self, dst: torch.Tensor, src: torch.Tensor, programs: int, pace_ps: int) -> None:
        nbytes = src.numel()
        if nbytes % WORD or src.data_ptr() % WORD or dst.data_ptr() % WORD:
            raise ValueError(f"paced copies move whole {WORD}-byte words ({nbytes} bytes)")
        state = self._stream_state(torch.cuda.current_stream(src.device).cuda_stream, src.device)
        words = nbytes // WORD
        paced_copy_kernel()[(programs,)](
            src.view(torch.int64),
            dst.view(torch.int64),
            words,
            pace_ps,
            state,
            BLOCK=self.block_words,
            num_warps=self.warps,
        )

    def _stream_state(self, stream: int, device: Any) -> torch.Tensor:
        """``stream``'s kernel counters (the first program's start, the next block), zeroed
        for its next copy: a stream's copies run one after another, so they share them.
        They are a normal tensor even when created inside inference mode: vLLM runs the
        forward, and so the first prefetch, under ``torch.inference_mode``, and a lowering's
        restore copy outside it zeroes the same counters, which an inference tensor refuses
        (the H100's first device-home level change, 2026-12-06: "Inplace update to
        inference tensor outside InferenceMode")."""
        state = self._state.get(stream)
        if state is None:
            with torch.inference_mode(False):
                state = self._state[stream] = torch.zeros(2, dtype=torch.int64, device=device)
        state.zero_()
        return state

    def _settle(self) -> None:
        """Account every timed copy that has finished (non-blocking, in order)."""
        while self._timed and self._timed[0][4].query():
            nbytes, scheduled, programs, start, end = self._timed.popleft()
            self.observe(nbytes, start.elapsed_time(end) * 1e6, scheduled, programs)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._settle()
        nbytes = src.numel()
        scheduled = self.schedule_GBps(nbytes)
        pace_ps = 0 if math.isinf(scheduled) else block_ps(scheduled, self.block_words)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._launch(dst, src, self.programs, pace_ps)
        end.record()
        self._timed.append((nbytes, scheduled, self.programs, start, end))

    def describe(self) -> str:
        return (
            f"paced to {self.target_GBps:.0f} GB/s by a copy kernel on {self.programs} "
            f"programs (CTAs of {self.warps} warps, {self.block_words * WORD >> 10} KiB "
            f"blocks; unpaced {self.raw_GBps:.0f} GB/s on them), each copy's launch and waits "
            "made up from its schedule"
        )


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
