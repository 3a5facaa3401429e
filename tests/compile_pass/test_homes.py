"""The offloaded layers' homes (fast-link issue, item 1): the configuration that picks one,
the device home's fit check, and the pacing plan of the emulated link."""

from __future__ import annotations

import pytest

from dynoff.compile_pass.homes import HomeError, PacePlan, check_device_home
from dynoff.policy.config import DynamicOffloadConfig

GIB = 1 << 30


def test_a_paced_copy_takes_the_target_bandwidths_time() -> None:
    nbytes, raw, target, clock = 930 << 20, 2000.0, 390.0, 1.98  # GB/s, GB/s, cycles/ns
    plan = PacePlan.for_copy(nbytes, target, raw, clock)
    assert plan.chunks * plan.chunk_bytes >= nbytes > (plan.chunks - 1) * plan.chunk_bytes
    assert plan.chunk_bytes % 256 == 0
    copy_ns = nbytes / raw
    spin_ns = plan.chunks * plan.spin_cycles / clock
    assert abs((copy_ns + spin_ns) - nbytes / target) / (nbytes / target) < 1e-3
    # A target at or above the device's own speed is not slowed down.
    assert PacePlan.for_copy(nbytes, 3000.0, raw, clock).spin_cycles == 0


def test_the_home_is_chosen_in_the_config_and_checked_with_the_fix() -> None:
    assert DynamicOffloadConfig().home == "host"
    device = DynamicOffloadConfig.from_dict(
        {"home": "device", "home_GBps": 390, "policy": {"max_level": 8}}
    )
    assert (device.home, device.home_GBps) == ("device", 390)
    with pytest.raises(ValueError, match="home='nvme'"):
        DynamicOffloadConfig.from_dict({"home": "nvme"})
    with pytest.raises(ValueError, match=r'home_GBps=390 paces the device home.*"home": "device"'):
        DynamicOffloadConfig.from_dict({"home_GBps": 390})
    with pytest.raises(ValueError, match=r'set "policy": \{"max_level": K\}'):
        DynamicOffloadConfig.from_dict({"home": "device"})


def test_a_device_home_must_fit_beyond_the_budget() -> None:
    layer = 930 << 20  # Qwen3-32B
    check_device_home(max_level=24, layer_bytes=layer, beyond_budget=50 * GIB)
    with pytest.raises(HomeError, match=r'"max_level": 27\}'):
        check_device_home(max_level=32, layer_bytes=layer, beyond_budget=50 * GIB)
