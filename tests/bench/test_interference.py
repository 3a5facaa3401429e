"""The interference report's arithmetic (the measurement itself runs on the GPU:
``python3 -m bench.interference``)."""

from __future__ import annotations

from bench.interference import summarize


def test_slowdowns_are_against_the_step_alone_and_the_emulation_is_labelled() -> None:
    steps = {
        "decode": {
            "none": [10.0, 10.2, 9.8],
            "host_pcie": [10.1, 10.3, 10.2],
            "device_paced": [10.6, 10.4, 10.5],
        }
    }
    copies = {"decode": {"host_pcie": {"bytes": 55e9, "seconds": 1.0}, "device_paced": {}}}
    rows = summarize(steps, copies)["decode"]
    assert rows["none"] == {"step_ms": 10.0, "slowdown": 1.0}
    assert rows["host_pcie"]["slowdown"] == 1.02 and rows["host_pcie"]["copy_GBps"] == 55.0
    assert "emulation" not in rows["host_pcie"]
    assert rows["device_paced"]["slowdown"] == 1.05 and rows["device_paced"]["emulation"]
    assert "copy_GBps" not in rows["device_paced"]  # no copy figures: none claimed
