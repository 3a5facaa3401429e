"""vLLM's GPU engine with the plugin against stock vLLM (Qwen3-8B, dummy weights), on the GPU
machine after the staging calls (``../shared/gpu/README.md``):

    source /tmp/site/env.sh && python3 -m pytest -m gpu tests/e2e/test_gpu_engine.py

Six engines over the same 256 requests (``bench.gpu.e2e_correctness``, one process each, every
decoder layer's weights redrawn distinct by ``bench.weights.distinct_weights``): stock vLLM
with its default graph mode and the plugin held at k = 0 (FULL graphs at k = 0: they must
agree exactly); the plugin forced 0 -> 18 -> 0 while the requests decode and the same
configuration held at k = 0 (``forced0-pw``), both with ``cudagraph_mode=PIECEWISE`` (one
graph mode, one configuration and the same graphs throughout: they must agree exactly, so a
KV page lost or a layer run on wrong weights at any level shows); the forced plugin on the
default graph mode (its dispatch: no step at k > 0 on a FULL graph); and the piecewise
forced schedule with each offloaded layer copied in with its partner's weights (the
negative control: it must differ). With the default graph mode the forced engine runs k = 0
on FULL graphs and k > 0 piecewise; on the H100 it gave the piecewise engine's tokens
exactly, and within 3 of 256 of stock (positions 204-213), which is reported, not asserted.
Two yardsticks turned out not to be: stock's own piecewise engine moved 239 of 256 requests
from stock's default mode, and the plugin held at 0 with its default configuration on
piecewise graphs (``k0-pw``) 240, from the first decode tokens and before the forced
engine's first level change, while the forced configuration held at 0 gave the forced
engine's tokens exactly (2026-12-06, H100; why piecewise engines split so is not known).
The k = 0 throughput ratio is a benchmark figure
(``bash bench/gpu/e2e_correctness.sh identity``), not asserted here.

The engines take longer than one 600 s device call (two Qwen3-8B start-ups per ~400 s).
Run them over calls on one warm machine, then point the test at the report the last call
wrote (it covers every engine found in the shared workdir)::

    E="python3 -m bench.gpu.e2e_correctness --model M --repeats 1 --max-level 18 --workdir /tmp/e2e"
    $E --engines stock k0 --out $OUT/e2e_a.json
    $E --engines forced forced0-pw --out $OUT/e2e_b.json
    $E --engines forced-pw forced-wrong-pw --out $OUT/e2e.json
    DYNOFF_E2E_REPORT=$OUT/e2e.json python3 -m pytest -m gpu tests/e2e/test_gpu_engine.py

``DYNOFF_E2E_REPORT`` may name several reports (``:``-separated), from calls on different
machines (``e2e_correctness.combine``); each pair asserted below is then still one
machine's, as long as each report holds both of its engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).parents[2]
MODEL = Path(os.environ.get("DYNOFF_GPU_MODEL", "/tmp/site/models/qwen3-8b"))
MAX_LEVEL = 18
ENGINES = ("stock", "k0", "forced", "forced0-pw", "forced-pw", "forced-wrong-pw")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    made = os.environ.get("DYNOFF_E2E_REPORT")
    if made:  # the engines ran in earlier calls (above): the same asserts on their reports
        from bench.gpu.e2e_correctness import combine

        paths = made.split(os.pathsep)
        result = json.loads(Path(paths[0]).read_text()) if len(paths) == 1 else combine(paths)
    else:
        if not MODEL.exists():
            pytest.skip(f"{MODEL} not staged (../shared/gpu/README.md)")
        tmp = tmp_path_factory.mktemp("e2e")
        out = tmp / "e2e.json"
        cmd = [sys.executable, "-m", "bench.gpu.e2e_correctness", "--model", str(MODEL)]
        cmd += ["--out", str(out), "--engines", *ENGINES, "--repeats", "1"]
        cmd += ["--max-level", str(MAX_LEVEL), "--workdir", str(tmp / "work")]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
    assert set(result["engines"]) >= set(ENGINES), sorted(result["engines"])
    failed = {m: e["error"][-500:] for m, e in result["engines"].items() if "error" in e}
    assert not failed, failed
    return result


def test_tokens_identical_to_stock(report: dict) -> None:
    assert report["requests"] >= 200
    identity = report["identity"]
    # The pair ran the same batches (each engine core in the generating process): a token
    # difference then comes from the weights or the KV, not from a different first step.
    schedules = report.get("schedules", {}).get("forced0-pw_vs_forced-pw")
    assert schedules is not None, "no schedules for the pair: its report predates them, rerun it"
    assert schedules["identical"], schedules
    # ... and compiled the same kernels: Inductor keeps the fastest of several reduction
    # kernels by timing them, and two compilations of one configuration differed in 240 of
    # 256 requests on the H100 (2026-12-06).
    for engine in ("forced0-pw", "forced-pw"):
        assert report["engines"][engine].get("compiled_untimed"), (engine, "rerun untimed")
    for pair in ("k0_vs_stock", "forced0-pw_vs_forced-pw"):
        assert identity[pair]["identical"], (pair, identity[pair])
    assert report["token_identical_piecewise"]


def test_the_identity_check_sees_a_layer_on_its_partners_weights(report: dict) -> None:
    """The negative control: with weights distinct per layer (``bench.weights``; vLLM's
    dummy weights are the same in every layer), the forced schedule with each offloaded
    layer copied in with its partner's weights must differ from the same engine held at
    k = 0 on the same graphs."""
    assert report["weights"] == "distinct"
    pair = report["identity"]["forced-wrong-pw_vs_forced0-pw"]
    assert report["negative_control_piecewise_detected"], pair
    assert pair["requests_differing"] >= report["requests"] // 2, pair


def test_no_step_at_k_above_0_was_dispatched_to_a_full_graph(report: dict) -> None:
    """The graph-dispatch hook, checked in the real engine (V2's CudaGraphManager): every
    step that needed the ops (k > 0, or a restore copy in flight) ran piecewise."""
    (dispatches,) = report["engines"]["forced"]["dispatches"]
    assert dispatches["piecewise_needed"] > 0
    assert dispatches["full_while_needed"] == 0


def test_levels_round_trip_under_load(report: dict) -> None:
    assert report["max_level_reached"] == MAX_LEVEL
    assert report["levels_visited"][0] == 0 and report["levels_visited"][-1] == 0
    assert report["level_changes"] >= 2 * MAX_LEVEL
    assert report["resize_failures"] == 0
    assert report.get("audit_failures", 0) == 0  # with --audit: no change altered live KV
