"""``bench.gpu.e2e_correctness --combine``: one report from engines that ran in several device
calls; a mode seen twice is kept as ``<mode>_2`` and compared with its first run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.gpu import e2e_correctness as e2e
from bench.gpu.e2e_correctness import combine


def call(tmp_path: Path, name: str, engines: dict, outputs: dict) -> str:
    path = tmp_path / f"{name}.json"
    result = {"command": f"run {name}", "machine": {"gpu": "H200"}, "route": "split"}
    path.write_text(json.dumps(result | {"engines": engines}))
    path.with_suffix(".outputs.json").write_text(json.dumps(outputs))
    return str(path)


def test_combine_names_repeats_and_compares_them(tmp_path: Path) -> None:
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    first = call(
        tmp_path,
        "a",
        {
            "stock": {"seconds": [4.0, 4.2], "decode_ms": 6.0},
            "k0": {"seconds": [4.1], "decode_ms": 6.2},
        },
        {"stock": same, "k0": other},
    )
    trace = {"level_changes": 4, "levels_visited": [0, 1, 2, 1, 0], "resize_failures": 0}
    second = call(
        tmp_path,
        "b",
        {"stock": {}, "forced": {"trace": trace}},
        {"stock": same, "forced": other},
    )
    report = combine([first, second])
    assert [c["command"] for c in report["calls"]] == ["run a", "run b"]
    assert set(report["engines"]) == {"stock", "k0", "stock_2", "forced"}
    identity = report["identity"]
    assert identity["stock_2_vs_stock"]["identical"] is True
    assert identity["forced_vs_k0"]["identical"] is True
    assert identity["k0_vs_stock"] == {
        "identical": False,
        "requests_differing": 1,
        "first_positions": [1],
    }
    assert report["token_identical"] is False and report["requests"] == 2
    assert report["k0_throughput_ratio"] == round(4.0 / 4.1, 4)
    assert report["max_level_reached"] == 2 and report["level_changes"] == 4


def test_one_graph_mode_pairs_and_committed_gzip_outputs(tmp_path: Path) -> None:
    """A report committed with its outputs gzip-compressed combines with a later call's;
    the piecewise pair (forced-pw against the plugin held at 0, k0-pw: the same graphs) and
    its negative control are reported apart from the default graph mode's pair, and stock's
    own piecewise engine (stock-pw) measures vLLM's graph modes, not the plugin."""
    import gzip

    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    first = call(tmp_path, "a", {"stock": {}, "forced": {}}, {"stock": same, "forced": other})
    outputs = Path(first).with_suffix(".outputs.json")
    outputs.with_name(outputs.name + ".gz").write_bytes(gzip.compress(outputs.read_bytes()))
    outputs.unlink()
    second = call(
        tmp_path,
        "b",
        {"stock-pw": {}, "k0-pw": {}, "forced-pw": {}, "forced-wrong-pw": {}},
        {"stock-pw": same, "k0-pw": other, "forced-pw": other, "forced-wrong-pw": same},
    )
    report = combine([first, second])
    assert report["token_identical"] is False
    assert report["token_identical_piecewise"] is True
    assert report["negative_control_piecewise_detected"] is True
    identity = report["identity"]
    assert identity["forced-pw_vs_k0-pw"]["identical"] is True
    assert identity["forced-wrong-pw_vs_k0-pw"]["requests_differing"] == 1
    assert identity["stock-pw_vs_stock"]["identical"] is True
    assert identity["forced-pw_vs_stock-pw"]["requests_differing"] == 1
    # Without k0-pw the piecewise pair is not judged at all (stock-pw is no yardstick).
    third = call(tmp_path, "c", {"forced-pw": {}}, {"forced-pw": other})
    assert "token_identical_piecewise" not in combine([first, third])


def test_the_forced_engine_is_judged_against_its_own_configuration_held_at_0(
    tmp_path: Path,
) -> None:
    """On the H100 (2026-12-06) the plugin held at 0 with the default configuration (k0-pw)
    differed from the forced engine in 240 of 256 requests from the first decode tokens,
    before any level change, while the forced configuration held at 0 (forced0-pw) gave the
    forced engine's tokens exactly: where forced0-pw ran, the pair is judged against it."""
    held, k0, wrong = [[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 5, 8]], [[9, 9, 9], [4, 5, 6]]
    first = call(
        tmp_path,
        "a",
        {"k0-pw": {}, "forced-pw": {}, "forced-wrong-pw": {}},
        {"k0-pw": k0, "forced-pw": held, "forced-wrong-pw": wrong},
    )
    second = call(tmp_path, "b", {"forced0-pw": {}}, {"forced0-pw": held})
    report = combine([first, second])
    assert report["piecewise_pair"] == "forced-pw_vs_forced0-pw"
    assert report["token_identical_piecewise"] is True
    assert report["negative_control_piecewise_detected"] is True
    identity = report["identity"]
    assert identity["forced0-pw_vs_forced-pw"]["identical"] is True
    assert identity["forced0-pw_vs_k0-pw"]["requests_differing"] == 2
    assert identity["forced-wrong-pw_vs_forced0-pw"]["requests_differing"] == 1
    # Without forced0-pw the pair falls back to k0-pw, and here fails.
    assert combine([first])["token_identical_piecewise"] is False


def test_the_schedules_say_whether_a_pair_ran_the_same_batches(tmp_path: Path) -> None:
    """On the H100 (2026-12-06) forced0-pw's first step ran 4 requests and forced-pw's 1 (the
    engine core in its own process had started before all 256 arrived), so the pair ran
    different batches and 1 request differed at position 220: the report says so beside
    the tokens, from each engine's trace."""
    same = [[0, 0], [192, 64], [0, 256]]
    trace = tmp_path / "forced-pw.jsonl"
    rows = [{"kind": "event", "event": "plan"}]
    rows += [
        {
            "kind": "step",
            "step": n + 1,
            "level": 0,
            "capacity_blocks": 64,
            "waiting": w,
            "running": r,
        }
        for n, (w, r) in enumerate([[0, 0], [195, 61], [0, 256]])
    ]
    trace.write_text("\n".join(json.dumps(r) for r in reversed(rows)))
    raced = e2e.engine_trace(trace, tmp_path, "forced-pw")["schedule"]
    assert raced == [[0, 0], [195, 61], [0, 256]]
    assert (tmp_path / "forced-pw_trace.jsonl").read_text() == trace.read_text()
    tokens = {"forced0-pw": [[1]], "forced-pw": [[1]], "k0-pw": [[1]]}
    engines = {"forced0-pw": {"schedule": same}, "forced-pw": {"schedule": raced}, "k0-pw": {}}
    schedules = e2e.compare(engines, tokens)["schedules"]
    assert schedules == {"forced0-pw_vs_forced-pw": {"identical": False, "first_step": 2}}
    engines["forced-pw"]["schedule"] = same
    schedules = e2e.compare(engines, tokens)["schedules"]
    assert schedules["forced0-pw_vs_forced-pw"] == {"identical": True, "first_step": None}


def test_the_identity_phase_compiles_every_engine_without_timing() -> None:
    """Inductor times several block shapes for each reduction kernel and keeps the fastest,
    whose summation order sets the last bits: two engines compiled apart then differ from
    their first tokens (240 of 256 on the H100, 2026-12-06, same batches, both at level 0).
    Every identity engine, stock's and the plugin's, must compile without that timing; the
    timed phases keep vLLM's defaults."""
    import argparse

    args = argparse.Namespace(
        phase="identity",
        gpu_memory_utilization=0.85,
        live_memory_utilization=0.2,
        kv_offloading_size=None,
        weights="distinct",
        route="split",
        kv_layout="auto",
        max_level=18,
        audit=True,
    )
    modes = ["stock", "stock-pw", "split", "partition", "k0", "k0-pw", "forced", "forced-pw"]
    modes += ["forced0-pw", "forced-wrong-pw"]
    for mode in modes:
        config = e2e.engine_kwargs(mode, "m", "t.jsonl", args)["compilation_config"]
        assert config["inductor_compile_config"] == e2e.UNTIMED_INDUCTOR, mode
    env = e2e.engine_env("identity", {"PATH": "/bin"})
    assert env["TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["PATH"] == "/bin"

    # Each engine's result says whether it compiled so (read in its own process, where
    # Inductor took the environment at import), and the GPU test asks it of the pair.
    import subprocess
    import sys

    check = (
        "from bench.gpu.e2e_correctness import compiled_untimed, UNTIMED_INDUCTOR as U; "
        "print(compiled_untimed({'inductor_compile_config': dict(U)}), compiled_untimed({}))"
    )
    root = Path(e2e.__file__).parents[2]
    timed = {k: v for k, v in env.items() if k not in e2e.UNTIMED_ENV}
    for environ, expected in ((env, "True False"), (timed, "False False")):
        environ = {**environ, "PATH": os.environ["PATH"]}
        run = subprocess.run(
            [sys.executable, "-c", check], env=environ, cwd=root, capture_output=True, text=True
        )
        assert run.stdout.strip() == expected, run.stderr[-2000:]

    args.phase = "live"
    config = e2e.engine_kwargs("live", "m", "t.jsonl", args)["compilation_config"]
    assert "inductor_compile_config" not in config
    assert "TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS" not in e2e.engine_env("live", {})


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_an_engine_cut_short_keeps_its_log_and_leaves_no_process(tmp_path: Path) -> None:
    """On the H100 (2026-12-06) an outer ``timeout`` cut an identity engine, and its whole
    log was lost with it (written only at the end). ``run_logged`` streams the log, kills
    the engine and what it started (vLLM's engine core) when its time runs out, and keeps
    the log's head and tail."""
    import sys
    import time

    script = tmp_path / "engine.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'core.pid')!r}, 'w').write(str(core.pid))\n"
        "print('started', flush=True)\n"
        "print('x' * 200_000, flush=True)\n"
        "print('still stepping', flush=True)\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "engine.log"
    start = time.monotonic()
    code = e2e.run_logged([sys.executable, str(script)], {}, log, timeout_s=3.0)
    assert code is None and time.monotonic() - start < 30
    text = log.read_text()
    assert text.startswith("started") and text.rstrip().endswith("still stepping")
    assert "characters cut" in text and len(text) < e2e.LOG_HEAD + e2e.LOG_TAIL + 100
    core = int((tmp_path / "core.pid").read_text())
    for _ in range(50):  # SIGKILL is asynchronous
        if not _running(core):
            break
        time.sleep(0.1)
    assert not _running(core)

    assert e2e.run_logged([sys.executable, "-c", "print('done')"], {}, log, 10.0) == 0
    assert log.read_text() == "done\n"
    assert e2e.run_logged([sys.executable, "-c", "raise SystemExit(3)"], {}, log, 10.0) == 3
