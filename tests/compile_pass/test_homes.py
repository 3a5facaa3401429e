"""The offloaded layers' homes (fast-link issue, item 1): the configuration that picks one,
the device home's fit check, and the pacing plan of the emulated link."""

from __future__ import annotations

import pytest

from dynoff.compile_pass.homes import HomeError, PacePlan, Pacer, check_device_home
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


def busy_gpu(pacer: Pacer, nbytes: int, copy_GBps: float, spin_delay_ns: float) -> float:
    """How long the pacer's plan for ``nbytes`` takes on a GPU whose kernels fill every SM
    (a model of the device, for the feedback loop): the chunks copy at ``copy_GBps``, and
    each spin waits ``spin_delay_ns`` for an SM before it starts."""
    plan = pacer.plan(nbytes)
    return (
        nbytes / copy_GBps
        + plan.chunks * plan.spin_cycles / pacer.cycles_per_ns
        + plan.spins * spin_delay_ns
    )


def feedback(copy_GBps: float, spin_delay_ns: float, copies: int = 30) -> Pacer:
    pacer = Pacer(390.0)
    pacer.raw_GBps, pacer.cycles_per_ns = 1480.0, 1.99  # the H100's, idle
    nbytes = 486_555_648  # one toy layer (bench.interference)
    for _ in range(copies):
        pacer.observe(nbytes, busy_gpu(pacer, nbytes, copy_GBps, spin_delay_ns))
    return pacer


def test_paced_copies_are_held_to_the_target_when_the_spins_are_delayed() -> None:
    """Open loop, spins delayed 25 us each behind a step's kernels make a 390 GB/s plan
    deliver ~285 GB/s (as the H100 did beside a decode step); the feedback brings it back."""
    nbytes = 486_555_648
    open_loop = Pacer(390.0)
    open_loop.raw_GBps, open_loop.cycles_per_ns = 1480.0, 1.99
    slow = nbytes / busy_gpu(open_loop, nbytes, 1480.0, 25_000)
    assert slow < 0.8 * 390
    pacer = feedback(1480.0, 25_000)
    assert pacer.achieved_GBps is not None
    last = nbytes / busy_gpu(pacer, nbytes, 1480.0, 25_000)
    assert abs(last - 390) / 390 < 0.01, last


def test_paced_copies_spin_more_when_the_device_copies_faster_than_calibrated() -> None:
    pacer = feedback(2500.0, 0.0)
    nbytes = 486_555_648
    assert abs(nbytes / busy_gpu(pacer, nbytes, 2500.0, 0.0) - 390) / 390 < 0.01


def test_an_unreachable_target_leaves_the_copies_unpaced_and_says_what_they_reached() -> None:
    """Beside compute that leaves the copies 300 GB/s, no spin can help: none is left, and
    the achieved bandwidth reports the emulated link's real speed."""
    pacer = feedback(300.0, 25_000, copies=60)
    assert pacer.plan(486_555_648).spin_cycles == 0
    assert pacer.achieved_GBps is not None and abs(pacer.achieved_GBps - 300) < 3


def test_the_feedback_settles_with_a_steps_copies_in_flight() -> None:
    """A step queues two copies per level before the first of them finishes, so each
    measurement lands up to 36 copies late (level 18). Corrected from the spin the measured
    copy used, the loop settles on the target; summed into the current spin it would
    overshoot by every copy in flight and swing."""
    nbytes, in_flight = 486_555_648, 36
    pacer = Pacer(390.0)
    pacer.raw_GBps, pacer.cycles_per_ns = 1480.0, 1.99
    queued: list[tuple[float, float]] = []  # (spin used, elapsed) of copies not yet seen
    rates = []
    for _ in range(400):
        used = pacer.spare_ns(nbytes)
        elapsed = busy_gpu(pacer, nbytes, 1480.0, 25_000)
        queued.append((used, elapsed))
        rates.append(nbytes / elapsed)
        if len(queued) > in_flight:
            used, elapsed = queued.pop(0)
            pacer.observe(nbytes, elapsed, used)
    assert all(abs(r - 390) / 390 < 0.01 for r in rates[-100:]), (
        min(rates[-100:]),
        max(rates[-100:]),
    )


def test_behind_long_kernels_the_copies_take_fewer_spins_and_still_hold_the_target() -> None:
    """Spins that each wait 200 us for an SM (kernels as long as a large GEMM's): 32 of
    them would cost 6.4 ms, five times the copy's 1.25 ms at 390 GB/s, and no spin time
    could take that back. The pacer halves the chunks, from the measured copies' own spin
    counts (36 copies in flight), until the waits fit, and holds the target."""
    nbytes, in_flight, delay = 486_555_648, 36, 200_000
    pacer = Pacer(390.0)
    pacer.raw_GBps, pacer.cycles_per_ns = 1480.0, 1.99
    queued: list[tuple[float, int, float]] = []
    rates = []
    for _ in range(800):  # ~22 steps at level 18: well under a second of serving
        spins = pacer.plan(nbytes).spins
        elapsed = busy_gpu(pacer, nbytes, 1480.0, delay)
        queued.append((pacer.spare_ns(nbytes), spins, elapsed))
        rates.append(nbytes / elapsed)
        if len(queued) > in_flight:
            used, spins, elapsed = queued.pop(0)
            pacer.observe(nbytes, elapsed, used, spins)
    assert pacer.plan(nbytes).chunks < 4
    last = rates[-100:]
    assert all(abs(r - 390) / 390 < 0.02 for r in last), (min(last), max(last))


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
