"""The start-up calibration on the host backend: it measures the link, the decode steps at
levels 0 and 1 and a real level change each way, and leaves every weight, KV group and
switch as it found them; a driver fault in either change never leaves the rank at a level
the scheduler does not know."""

from __future__ import annotations

import pytest
import torch

from dynoff.allocator import VmmArena
from dynoff.allocator.kv_cache import VmmKVCache
from dynoff.compile_pass import calibrate
from dynoff.compile_pass.levels import LevelChanger
from dynoff.compile_pass.placement import WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from dynoff.compile_pass.runtime import OffloadRuntime
from dynoff.policy.geometry import CapacityPlan
from tests.allocator.kv_config import kv_config
from tests.compile_pass.toy_model import ToyDecoder

PAGE = 64 << 10
PLAN = CapacityPlan(group_blocks=1, base_groups=8, max_level=2, layer_pages=2, pages_per_group=1)


def rank() -> tuple[torch.nn.Module, LevelChanger, VmmArena, VmmKVCache]:
    torch.manual_seed(0)
    model = ToyDecoder(8).requires_grad_(False)
    arena = VmmArena("host", page_size=PAGE)
    placement = WeightPlacement(arena, model.layers, max_level=2)
    engine = PrefetchEngine.for_placement(placement)
    kv = VmmKVCache(arena, kv_config(64, 1, PAGE), group_blocks=1, active_groups=8)
    levels = LevelChanger(0, placement, kv, engine, OffloadRuntime(8, engine))
    return model, levels, arena, kv


def test_calibration_measures_and_leaves_everything_as_it_was() -> None:
    model, levels, _, kv = rank()
    x = torch.randn(1, 4, 64)
    reference = model(x)
    seen_levels: list[int] = []

    def decode(batch: int) -> None:
        seen_levels.append(levels.runtime.level)
        model(torch.randn(1, batch, 64))

    cal = calibrate.calibrate(levels, PLAN, decode, max_batch=64, cuda=False)
    assert cal.h2d_GBps > 0 and cal.layer_copy_ms > 0
    assert [row[0] for row in cal.decode_steps] == [8, 64]  # 256 capped at the max batch
    assert all(full > 0 and pw > 0 and k1 > 0 for _, full, pw, k1 in cal.decode_steps)
    assert cal.stall_up_ms > 0 and cal.stall_down_ms > 0
    assert set(seen_levels) == {0, 1}  # the level-1 rows really ran at level 1
    assert levels.level == 0 and levels.runtime.level == 0
    assert not levels.runtime.force_piecewise
    assert sorted(kv.backed) == list(range(8))  # level 1's groups unmapped again
    assert torch.equal(model(x), reference)


def test_without_graphs_only_the_link_and_the_change_are_measured() -> None:
    _, levels, _, _ = rank()
    cal = calibrate.calibrate(levels, PLAN, None, max_batch=64, cuda=False)
    assert cal.decode_steps == () and cal.piecewise_penalty_ms == 0.0
    assert cal.stall_up_ms > 0 and levels.level == 0


def test_a_fault_in_the_change_up_leaves_level_0() -> None:
    model, levels, arena, kv = rank()
    x = torch.randn(1, 4, 64)
    reference = model(x)
    arena._inject_failure(2)
    with pytest.raises(RuntimeError, match="0 -> 1 failed"):
        calibrate.calibrate(levels, PLAN, None, max_batch=64, cuda=False)
    assert levels.level == 0 and sorted(kv.backed) == list(range(8))
    assert torch.equal(model(x), reference)


def test_a_persistent_fault_in_the_change_down_stops_start_up(monkeypatch) -> None:
    _, levels, arena, _ = rank()
    original = levels.apply

    def apply(command):  # every change down fails in the driver: a fault on demand
        if command.target_level == 0:
            arena._inject_failure(0)
        return original(command)

    monkeypatch.setattr(levels, "apply", apply)
    with pytest.raises(calibrate.CalibrationLeftLevel, match="failed twice"):
        calibrate.calibrate(levels, PLAN, None, max_batch=64, cuda=False)
    assert levels.level == 1  # what the error says: start-up must not go on


def test_one_fault_in_the_change_down_is_retried(monkeypatch) -> None:
    model, levels, arena, kv = rank()
    x = torch.randn(1, 4, 64)
    reference = model(x)
    original, downs = levels.apply, []

    def apply(command):
        if command.target_level == 0:
            downs.append(command.command_id)
            if len(downs) == 1:
                arena._inject_failure(0)  # the first change down fails in the driver
        return original(command)

    monkeypatch.setattr(levels, "apply", apply)
    cal = calibrate.calibrate(levels, PLAN, None, max_batch=64, cuda=False)
    assert len(downs) == 2 and cal.stall_down_ms > 0
    assert levels.level == 0 and sorted(kv.backed) == list(range(8))
    assert torch.equal(model(x), reference)


def test_a_change_that_tears_the_rank_stops_start_up(monkeypatch) -> None:
    """The change down's restore fails and its undo fails in the driver: the rank is at no
    level. On the H100 (2026-12-06) the worker caught that as a failed calibration, logged
    that it stops, and served on, with the weights at level 1 and the scheduler at 0. The
    calibration raises the error that stops start-up."""
    _, levels, arena, _ = rank()

    def failing(layer: int, what: str, timed: bool = False) -> None:
        arena._inject_failure(0)  # sharing the region again fails in the driver too
        raise RuntimeError("the restore copy failed")  # a fault on demand

    monkeypatch.setattr(levels.engine, "_copy_in", failing)
    with pytest.raises(calibrate.CalibrationLeftLevel, match=r"at no level.*restore copy failed"):
        calibrate.calibrate(levels, PLAN, None, max_batch=64, cuda=False)
    arena._inject_failure(-1)
