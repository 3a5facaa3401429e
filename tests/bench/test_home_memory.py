"""bench.home_memory reads the KV cache each server got from its vLLM log."""
# ruff: noqa: E501  (vLLM log lines as they are)

from __future__ import annotations

from bench.home_memory import compare, read_log

STOCK = """\
(EngineCore pid=700) INFO 12-02 19:18:14 [gpu_worker.py:560] Available KV cache memory: 12.36 GiB
(EngineCore pid=700) INFO 12-02 19:18:14 [kv_cache_utils.py:2177] GPU KV cache size: 50,592 tokens
"""
PLUGIN = """\
(EngineCore pid=991) INFO 12-07 02:10:00 [worker_base.py:272] dynamic offload: 64 decoder layers of 960.0 MiB packed into VMM (cuda backend), max level 32, 64 layers homed on the host (the driver's host pages; 11.5 s)
(EngineCore pid=991) INFO 12-07 02:11:00 [gpu_worker.py:560] Available KV cache memory: 12.21 GiB
(EngineCore pid=991) INFO 12-07 02:11:00 [kv_cache_utils.py:2177] GPU KV cache size: 50,160 tokens
"""


def test_the_kv_each_server_got_is_read_and_compared_to_the_first() -> None:
    rows = {"stock": read_log(STOCK), "plugin": read_log(PLUGIN), "broken": read_log("")}
    assert rows["stock"] == {
        "available_kv_gib": 12.36,
        "kv_tokens": 50592,
        "layers_homed": 0,
        "homes": None,
    }
    assert rows["plugin"]["kv_tokens"] == 50160
    assert rows["plugin"]["layers_homed"] == 64
    assert rows["plugin"]["homes"] == "the driver's host pages"
    result = compare(rows)
    assert result["baseline"] == "stock"
    assert result["available_kv_ratio"] == {"stock": 1.0, "plugin": 0.98786, "broken": None}
