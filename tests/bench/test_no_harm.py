"""The no-harm report's arithmetic on hand-made run records (the serving runs themselves are
covered by tests/e2e/test_serve_bench.py)."""

from __future__ import annotations

import json
from typing import Any

from bench.no_harm import compare, rate_of


def run(system: str, uuid: str | None, **client: float) -> dict[str, Any]:
    base = {
        "request_throughput": 10.0,
        "mean_e2el_ms": 1000.0,
        "p99_e2el_ms": 3000.0,
        "p99_ttft_ms": 200.0,
        "median_tpot_ms": 30.0,
    }
    machine = {"gpu": "NVIDIA H200"} | ({"gpu_uuid": uuid} if uuid else {})
    point = {"regime": "b", "workload": "sharegpt", "trace": "poisson --rate 18 --seconds 60"}
    return {"system": system, "point": point, "machine": machine, "client": base | client}


def test_ratios_and_misses_are_read_against_the_bounds() -> None:
    row = compare(
        run("stock", "GPU-a"), run("plugin", "GPU-a", p99_ttft_ms=260.0, mean_e2el_ms=1010.0)
    )
    assert row["rate"] == 18.0
    assert row["ttft_p99_ratio"] == 1.3 and row["e2e_mean_ratio"] == 1.01
    assert row["misses"] == ["ttft_p99_ratio"]  # 1.01 is inside the 1.02 bound, 1.3 is not
    assert row["same_gpu"] is True


def test_a_pair_from_two_gpus_is_flagged() -> None:
    assert compare(run("stock", "GPU-a"), run("plugin", "GPU-b"))["same_gpu"] is False
    assert compare(run("stock", None), run("plugin", "GPU-b"))["same_gpu"] is None


def test_the_kv_each_serves_with_at_level_0_is_set_beside_the_ratios() -> None:
    # Stock's KV from its server's cache_config_info, the plugin's level-0 capacity from its
    # trace (a JSON round trip makes the level a string); runs that recorded neither, none.
    stock, plugin = run("stock", "GPU-a"), run("plugin", "GPU-a")
    assert "kv_blocks_ratio" not in compare(stock, plugin)
    stock["server_kv_blocks"] = 3162
    plugin["server_kv_blocks"] = 10575  # the pool for its top level, not what level 0 uses
    plugin["plugin"] = {"capacity_blocks_by_level": {"0": 3135, "1": 3367}}
    row = compare(stock, plugin)
    assert row["kv_blocks_level_0"] == {"stock": 3162, "plugin": 3135}
    assert row["kv_blocks_ratio"] == 0.9915
    assert row["misses"] == []  # reported, not bounded


def test_a_pair_whose_graphs_came_different_ways_is_flagged() -> None:
    """A server that loads its graph from vLLM's compile cache profiles less activation, so
    more KV, than one that compiles it: the pin_homes pair on an H100 (stock loaded, the
    plugin compiled) gave stock 28 blocks the plugin was not given. Read from each server's
    log as the H100's servers wrote it."""
    from bench.serve_bench import server_profile

    loaded = (
        "INFO 12-07 15:04:09 [backends.py:292] Directly load the compiled graph(s) for compile "
        "range (1, 8192) from the cache, took 2.878 s\n"
        "INFO 12-07 15:04:12 [gpu_worker.py:560] Available KV cache memory: 12.48 GiB\n"
        "INFO 12-07 15:04:21 [gpu_worker.py:857] Free memory on device (78.66/79.18 GiB) on "
        "startup. Desired GPU memory utilization is (0.95, 75.22 GiB). Actual usage is 61.03 "
        "GiB for weight, 1.48 GiB for peak activation, 0.22 GiB for non-torch memory\n"
    )
    compiled = (
        "INFO 12-07 15:11:39 [backends.py:393] Compiling a graph for compile range (1, 8192) "
        "takes 17.48 s\n"
        "INFO 12-07 15:11:51 [gpu_worker.py:560] Available KV cache memory: 12.21 GiB\n"
        "Actual usage is 2.91 GiB for weight, 1.61 GiB for peak activation, 58.49 GiB\n"
    )
    assert server_profile(loaded) == {
        "kv_GiB": 12.48,
        "peak_activation_GiB": 1.48,
        "graph": "loaded",
    }
    assert server_profile(compiled)["graph"] == "compiled"
    assert server_profile(compiled)["peak_activation_GiB"] == 1.61
    assert server_profile("INFO CPU KV cache")["graph"] is None  # vLLM's CPU build: unsaid
    stock, plugin = run("stock", "GPU-a"), run("plugin", "GPU-a")
    assert "same_graph_source" not in compare(stock, plugin)  # runs before the record
    stock["server_profile"] = server_profile(loaded)
    plugin["server_profile"] = server_profile(compiled)
    row = compare(stock, plugin)
    assert row["graphs"] == {"stock": "loaded", "plugin": "compiled"}
    assert row["same_graph_source"] is False
    stock["server_profile"] = server_profile(compiled)
    assert compare(stock, plugin)["same_graph_source"] is True


def test_the_rate_is_read_from_the_trace_arguments() -> None:
    assert rate_of({"trace": "bursty --lull-rate 3 --burst-rate 18 --cycles 2"}) == "3/18"
    assert rate_of({"trace": "poisson --workload longprompt --rate 2 --seconds 90"}) == 2.0
    assert rate_of({"rate": 5}) == 5


def test_failed_requests_are_counted_per_system_with_the_disconnects_apart(tmp_path) -> None:
    from bench.no_harm import report

    stock, plugin = run("stock", "GPU-a", failed=0), run("plugin", "GPU-a", failed=2)
    plugin["client"]["failures"] = [
        {"index": 3, "error": "aiohttp.client_exceptions.ServerDisconnectedError: Server"},
        {"index": 8, "error": "HTTP 500: engine dead"},
    ]
    paths = []
    for i, record in enumerate((stock, plugin)):
        record["command"] = "serve_bench"
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(record))
        paths.append(str(path))
    result = report(paths)
    assert result["failed_requests"] == {"stock": 0, "plugin": 2}
    assert result["failed_disconnected"] == {"stock": 0, "plugin": 1}
