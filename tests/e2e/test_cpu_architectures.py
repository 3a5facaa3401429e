"""Decoder families other than Llama on vLLM's real CPU engine with the plugin
(:data:`bench.tiny_checkpoint.ARCHITECTURES`: Qwen2's attention biases, Phi-3's fused QKV
and gate-up projections, Gemma 3's sliding-window layers beside full ones, its own norms
and scaled embeddings). Random weights that matter, greedy sampling,
one engine per subprocess, as in ``test_cpu_engine.py``.

For each: the forced level schedule (0 -> 2 -> 1 -> 2 while 6 requests decode) is
token-identical to the plugin held at k = 0 (the same graphs: the yardstick
``test_cpu_engine.py`` explains), every change passes the engine's audit, the KV the forward
reads lies in the plugin's VMM ranges; and the same schedule with each offloaded layer
copied in with its partner's weights changes the outputs, so the comparison can see a
wrong layer in this family. The families run their forced schedule with ``pin_homes``
"first_raise" (the default: each level's homes page-locked on its first entry, a no-op
without CUDA but the same bookkeeping), one with "start" (all locked while packing): when
the levels lock must not change what is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tiny_checkpoint import ARCHITECTURES, make_hf_checkpoint
from tests.e2e.engines import run_engine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_forced_levels_are_token_identical_on_another_family(
    architecture: str, tmp_path: Path
) -> None:
    model = make_hf_checkpoint(tmp_path / architecture, architecture)
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == [architecture]
    held = run_engine("k0", model, tmp_path)
    pin = "start" if architecture == "Phi3ForCausalLM" else "first_raise"
    forced = run_engine("forced", model, tmp_path, pin_homes=pin)
    assert len(forced["outputs"]) == 6 and all(len(o) == 24 for o in forced["outputs"])
    assert forced["outputs"] == held["outputs"]
    trace = forced["trace"]
    assert trace["levels_visited"] == [0, 1, 2, 1, 2]
    assert trace["resize_failures"] == 0 and trace["audit_failures"] == 0
    assert forced["kv_outside_vmm"] == [[]]
    assert held["trace"]["levels_visited"] == [0]
    wrong = run_engine("forced-wrong", model, tmp_path)
    assert wrong["outputs"] != held["outputs"]
    assert wrong["trace"]["audit_failures"] > 0
