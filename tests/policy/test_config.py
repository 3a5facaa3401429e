"""Every bad policy configuration is refused with a message that says the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynoff.policy.config import (
    HOST_HEADROOM,
    DynamicOffloadConfig,
    HostShare,
    PolicyConfig,
    kv_tier_host_bytes,
)

GIB = 1 << 30


def test_the_audit_baseline_defaults_to_50_steps_or_the_whole_window() -> None:
    assert PolicyConfig().audit_baseline == 50
    assert PolicyConfig(audit_window_steps=20).audit_baseline == 20  # a short window alone
    assert PolicyConfig(audit_window_steps=20, audit_baseline_steps=12).audit_baseline == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low_threshold": 0.9, "high_threshold": 0.9}, "must be below"),
        ({"low_threshold": 0.95, "high_threshold": 0.9}, "must be below"),
        ({"high_threshold": 1.0}, r"must lie in \(0, 1\)"),
        ({"low_threshold": 0.0}, r"must lie in \(0, 1\)"),
        ({"high_threshold": -0.2}, r"must lie in \(0, 1\)"),
        ({"cooldown_steps": -1}, "cooldown_steps=-1 must be >= 0"),
        ({"max_level": -1}, "max_level=-1 must be >= 0"),
        ({"warmup_samples": 0}, "warmup_samples must be >= 1"),
        ({"mix_steps": 0}, "mix_steps must be >= 1"),
        ({"drain_lag_steps": -2}, "drain_lag_steps=-2"),
        ({"descend_margin": -0.1}, "descend_margin=-0.1 must be >= 0"),
        ({"estimator": "magic"}, "use 'measured' or 'model'"),
        ({"proxy": "tokens"}, "use 'decode' or 'model'"),
        ({"audit_baseline_steps": 300}, r"audit_baseline_steps=300 must be between 10 and"),
        ({"audit_baseline_steps": 5}, r"audit_window_steps \(200\)"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_max_level_is_checked_against_half_the_layers() -> None:
    assert PolicyConfig().resolve_max_level(64, GIB, 1000 * GIB) == 32
    assert PolicyConfig().resolve_max_level(7, GIB, 1000 * GIB) == 3
    with pytest.raises(ValueError, match=r"exceeds N/2=32 .* set max_level <= 32"):
        PolicyConfig(max_level=33).resolve_max_level(64, GIB, 1000 * GIB)


def test_max_level_is_checked_against_pinned_memory() -> None:
    # 8 levels x 2 layers x 1 GiB = 16 GiB needed, 10 available: at most 5 levels.
    with pytest.raises(ValueError, match=r"needs 16\.0 GiB of pinned .* set max_level <= 5"):
        PolicyConfig(max_level=8).resolve_max_level(64, GIB, 10 * GIB)
    assert PolicyConfig(max_level=5).resolve_max_level(64, GIB, 10 * GIB) == 5


def test_the_default_max_level_is_the_largest_the_host_can_pin() -> None:
    """Unset, max_level is N/2 where the host memory holds it and the largest level that
    fits where it does not, instead of refusing to start."""
    assert PolicyConfig().resolve_max_level(64, GIB, 10 * GIB) == 5
    assert PolicyConfig().resolve_max_level(64, GIB, GIB) == 0
    assert PolicyConfig().resolve_max_level(64, GIB, -GIB) == 0
    assert PolicyConfig().resolve_max_level(64, GIB, 64 * GIB) == 32


def test_ranks_agree_on_one_max_level_from_what_their_hosts_can_pin() -> None:
    """Ranks on one host pin at the same time, so they split its memory (less the
    headroom and what a CPU KV tier will pin); every rank gets the tightest rank's level."""
    one = HostShare("a", available=100 * GIB, total=100 * GIB, layer_bytes=GIB)
    assert HostShare.budgets([one]) == [int((1 - HOST_HEADROOM) * 100 * GIB)]
    assert PolicyConfig().fit_max_level(128, [one]) == 45  # 90 GiB / 2 GiB a level
    assert PolicyConfig().fit_max_level(64, [one]) == 32  # N/2 fits
    # Two ranks on host "a" (one saw less free, after some other allocation) and one on "b".
    shares = [
        HostShare("a", 100 * GIB, 100 * GIB, GIB, reserved=4 * GIB),
        HostShare("a", 96 * GIB, 100 * GIB, GIB, reserved=4 * GIB),
        HostShare("b", 100 * GIB, 100 * GIB, GIB, reserved=4 * GIB),
    ]
    budgets = HostShare.budgets(shares)
    assert budgets[0] == budgets[1] == (96 * GIB - int(0.1 * 100 * GIB) - 8 * GIB) // 2
    assert budgets[2] == 100 * GIB - int(0.1 * 100 * GIB) - 4 * GIB
    assert PolicyConfig().fit_max_level(128, shares) == budgets[0] // (2 * GIB) == 19
    with pytest.raises(ValueError, match=r"set max_level <= 19.*tightest of 3 ranks"):
        PolicyConfig(max_level=20).fit_max_level(128, shares)


def test_only_a_default_max_level_cut_short_is_reported() -> None:
    """The operator hears why the default max level is below N/2; an explicit max_level (the
    microbenchmark's 0, 2026-12-06 on an H100) is what was asked for, and says nothing."""
    roomy = [HostShare("gpu-host", 124 * GIB, 125 * GIB, GIB)]
    assert PolicyConfig(max_level=0).capped_note(64, roomy, 0) is None
    assert PolicyConfig().capped_note(64, roomy, PolicyConfig().fit_max_level(64, roomy)) is None
    tight = [HostShare("a", 40 * GIB, 40 * GIB, GIB), HostShare("b", 20 * GIB, 20 * GIB, GIB)]
    level = PolicyConfig().fit_max_level(64, tight)
    note = PolicyConfig().capped_note(64, tight, level)
    assert level == 9 and note is not None
    assert note.startswith("max level 9, not 32: 18.0 GiB of host memory may be pinned for rank 1")
    assert '"max_level": K' in note


def test_a_cpu_kv_tier_is_counted_against_the_pinnable_memory() -> None:
    from vllm.config import KVTransferConfig

    class Config:
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 8.0 * GIB},
        )

    assert kv_tier_host_bytes(Config()) == 8 * GIB
    Config.kv_transfer_config = None  # type: ignore[assignment]
    assert kv_tier_host_bytes(Config()) == 0


def test_model_estimator_needs_a_model() -> None:
    from dynoff.policy.latency import LatencyEstimator

    with pytest.raises(ValueError, match="needs an OffloadCostModel or a way to calibrate"):
        LatencyEstimator(PolicyConfig(estimator="model"))


def test_plugin_config_parses_and_refuses_unknown_keys() -> None:

    config = DynamicOffloadConfig.from_dict(
        {"policy": {"cooldown_steps": 5, "warmup": True}, "level_schedule": [[0, 1], [9, 0]]}
    )
    assert config.policy.cooldown_steps == 5 and config.policy.warmup
    assert [config.forced_level(s) for s in (0, 8, 9, 50)] == [1, 1, 0, 0]
    assert DynamicOffloadConfig.from_dict(None).forced_level(3) is None
    with pytest.raises(ValueError, match=r"unknown dynamic_offload keys \['levels'\]"):
        DynamicOffloadConfig.from_dict({"levels": [1]})
    with pytest.raises(ValueError, match=r"unknown policy keys \['tau'\]"):
        DynamicOffloadConfig.from_dict({"policy": {"tau": 0.3}})
    with pytest.raises(ValueError, match="increasing steps"):
        DynamicOffloadConfig.from_dict({"level_schedule": [[5, 1], [2, 0]]})
    with pytest.raises(ValueError, match="h2d_GBps=0 must be > 0"):
        DynamicOffloadConfig.from_dict({"h2d_GBps": 0})
    with pytest.raises(ValueError, match="multiple of 4096"):
        DynamicOffloadConfig.from_dict({"host_page_size": 1000})
    with pytest.raises(ValueError, match=r"kv_layout='interleaved': use one of"):
        DynamicOffloadConfig.from_dict({"kv_layout": "interleaved"})
    assert DynamicOffloadConfig.from_dict({"kv_layout": "packed"}).kv_layout == "packed"
    assert DynamicOffloadConfig().kv_layout == "auto"  # packed where it applies
    with pytest.raises(
        ValueError, match=r"pin_homes='lazy': use one of \('start', 'first_raise'\)"
    ):
        DynamicOffloadConfig.from_dict({"pin_homes": "lazy"})
    assert DynamicOffloadConfig.from_dict({"pin_homes": "first_raise"}).pin_homes == "first_raise"
    assert DynamicOffloadConfig().pin_homes == "first_raise"


def test_messages_survive_pickling() -> None:
    import pickle

    from dynoff.policy.messages import OffloadCommand, ResizeOutcome, StepReport

    command = OffloadCommand(3, 10, 2, map_groups=(4, 5), safe_after_step=9)
    report = StepReport(10, 2, 12.5, 8, 0, (ResizeOutcome(3, 1, False, "boom"),))
    assert pickle.loads(pickle.dumps(command)) == command
    assert pickle.loads(pickle.dumps(report)).failed(3)[0].error == "boom"


def test_level_file_forces_the_level_while_it_exists(tmp_path: Path) -> None:
    control = tmp_path / "level"
    config = DynamicOffloadConfig.from_dict(
        {"level_file": str(control), "level_schedule": [[0, 1]]}
    )
    assert config.forced_level(5) == 1  # no file yet: the schedule
    control.write_text("3\n")
    assert config.forced_level(5) == 3
    control.write_text("")  # half-written: ignored
    assert config.forced_level(5) == 1
