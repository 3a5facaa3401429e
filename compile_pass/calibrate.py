"""Start-up calibration on the running engine: what a level costs on *this* machine.

Run by the worker after vLLM's warm-up and graph capture, before the first request, so the
policy prices levels with this machine's figures instead of a user's guess:

* **link**: one offloadable layer copied from its pinned host tensor into its own GPU region
  (the bytes it already holds, so nothing changes), best of a few: the link's bandwidth and
  one layer's copy time, over the very path the prefetches take;
* **piecewise penalty**: decode steps of a few batch sizes through vLLM's own dummy run,
  dispatched as at k = 0 (FULL graphs) and as at k > 0 (piecewise), CUDA-event timed;
* **level change**: a real change 0 -> 1 and back, with level 1's KV groups (no block of
  theirs is handed out before serving starts): the engine stall each direction costs;
* **level 1**: while there, the same decode steps again: what a level costs on this
  machine, which the policy checks its latency model against before trusting it.

Everything is measured with the device idle; the serving-time stall also waits for the step
already queued, which the policy adds from its measured step times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.logger import init_logger

from dynoff.compile_pass.levels import LevelChanger, RanksDivergedError
from dynoff.policy.geometry import CapacityPlan
from dynoff.policy.messages import Calibration, OffloadCommand, ResizeOutcome

logger = init_logger("vllm.dynoff.calibrate")

DECODE_BATCHES = (8, 64, 256)
REPEATS = 5


def link(
    sources: dict[int, torch.Tensor],
    regions: dict[int, torch.Tensor],
    copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> float:
    """Bytes per second of one layer's copy from its home (best of ``REPEATS``), through
    ``copy`` (the prefetch engine's, paced where the home is an emulated link)."""
    layer = next(iter(sources))
    src, dst = sources[layer], regions[layer]
    if dst.device.type == "cpu":
        return _host_copy_bandwidth(src, dst)
    best = float("inf")
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if copy is None:
            dst.copy_(src, non_blocking=True)
        else:
            copy(dst, src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / best


def _host_copy_bandwidth(src: torch.Tensor, dst: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() * src.element_size() / best


def decode_step_ms(run: Callable[[int], Any], batch: int, cuda: bool) -> float:
    """Median time of ``run(batch)`` (one dummy decode step), after one untimed run."""
    run(batch)
    samples = []
    for _ in range(REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            run(batch)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run(batch)
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def decode_steps(
    run: Callable[[int], Any],
    set_piecewise: Callable[[bool], None],
    batches: Sequence[int],
    cuda: bool,
) -> list[tuple[int, float, float]]:
    """(batch, FULL ms, piecewise ms) per batch size, at level 0."""
    rows = []
    for batch in batches:
        set_piecewise(False)
        full = decode_step_ms(run, batch, cuda)
        set_piecewise(True)
        try:
            piecewise = decode_step_ms(run, batch, cuda)
        finally:
            set_piecewise(False)
        rows.append((batch, full, piecewise))
    return rows


class CalibrationLeftLevel(RuntimeError):
    """The calibration's change back to level 0 failed twice, or a change tore the rank
    (:class:`~dynoff.compile_pass.levels.RanksDivergedError`): this rank cannot serve at the
    level the scheduler starts from. Start-up stops with this error, never silently."""


def level_change(
    levels: LevelChanger, plan: CapacityPlan, at_level_1: Callable[[], Any]
) -> tuple[float, float, float]:
    """(up ms, down ms, driver ms of both) of a real change 0 -> 1 -> 0 on level 1's
    groups, running ``at_level_1()`` in between. A failed change up leaves level 0 (the
    change rolls back); a failed change down is tried once more, then raises
    :class:`CalibrationLeftLevel`."""
    groups = tuple(range(plan.groups_at(0), plan.groups_at(1)))

    def apply(command: OffloadCommand) -> ResizeOutcome:
        try:
            return levels.apply(command)
        except RanksDivergedError as exc:  # no level to serve at: start-up must stop
            raise CalibrationLeftLevel(
                f"the calibration's level change to {command.target_level} left this rank "
                f"at no level: {exc}"
            ) from exc

    up = apply(OffloadCommand(-1, -1, 1, map_groups=groups))
    if not up.ok:
        raise RuntimeError(f"calibration level change 0 -> 1 failed: {up.error}")
    try:
        at_level_1()
    finally:
        down = apply(OffloadCommand(-2, -1, 0, unmap_groups=groups))
        if not down.ok:
            down = apply(OffloadCommand(-3, -1, 0, unmap_groups=groups))
        if not down.ok:
            raise CalibrationLeftLevel(
                f"the calibration's level change 1 -> 0 failed twice ({down.error}); this rank "
                "would serve at level 1 while the scheduler starts at 0. Set "
                "policy.max_level to 0 to serve without offloading, and report the error"
            )
    return up.remap_ms, down.remap_ms, up.driver_ms + down.driver_ms


def calibrate(
    levels: LevelChanger,
    plan: CapacityPlan,
    run_decode: Callable[[int], Any] | None,
    max_batch: int,
    cuda: bool,
) -> Calibration:
    """Measure this machine (see the module docstring). ``run_decode`` is None where there
    are no CUDA graphs (vLLM's CPU engine): there is no piecewise penalty to measure."""
    engine = levels.engine
    lock_ms = 0.0
    if plan.max_level > 0:  # the link is measured from level 1's homes, page-locked
        levels.placement.lock_level(1)
        lock_ms = levels.placement.last_lock_ms  # 0 where they were locked at start-up
    bandwidth = (
        link(engine.sources, engine.destinations, engine.copy_bytes) if engine.sources else 0.0
    )
    layer_bytes = levels.placement.layer_bytes
    rows: list[tuple[int, float, float]] = []
    batches: list[int] = []
    if run_decode is not None:
        batches = sorted({min(b, max_batch) for b in DECODE_BATCHES})
        rows = decode_steps(
            run_decode, lambda on: setattr(levels.runtime, "force_piecewise", on), batches, cuda
        )
    level_1: list[float] = []

    def at_level_1() -> None:
        if run_decode is not None:
            level_1.extend(decode_step_ms(run_decode, b, cuda) for b in batches)

    up_ms = down_ms = driver_ms = 0.0
    if plan.max_level > 0:
        up_ms, down_ms, driver_ms = level_change(levels, plan, at_level_1)
    penalties = [pw - full for _, full, pw in rows]
    if len(level_1) != len(rows):
        level_1 = [0.0] * len(rows)
    return Calibration(
        h2d_GBps=bandwidth / 1e9,
        layer_copy_ms=layer_bytes / bandwidth * 1e3 if bandwidth else 0.0,
        piecewise_penalty_ms=max(0.0, statistics.median(penalties)) if penalties else 0.0,
        decode_steps=tuple(
            (b, full, pw, k1) for (b, full, pw), k1 in zip(rows, level_1, strict=True)
        ),
        stall_up_ms=up_ms,
        stall_down_ms=down_ms,
        driver_ms=driver_ms,
        lock_ms=lock_ms,
    )


def describe(cal: Calibration) -> str:
    """The one log line."""
    steps = ", ".join(f"b={b} {full:.1f}/{pw:.1f}/{k1:.1f}" for b, full, pw, k1 in cal.decode_steps)
    return (
        f"link {cal.h2d_GBps:.1f} GB/s (one layer copies in {cal.layer_copy_ms:.1f} ms); "
        f"piecewise penalty {cal.piecewise_penalty_ms:.2f} ms"
        + (f" (decode ms FULL/piecewise/level 1: {steps})" if steps else " (no CUDA graphs)")
        + f"; level change 0->1 {cal.stall_up_ms:.1f} ms, 1->0 {cal.stall_down_ms:.1f} ms "
        f"({cal.driver_ms:.1f} ms in the driver)"
        + (f"; a level's homes page-locked in {cal.lock_ms:.1f} ms" if cal.lock_ms else "")
    )
