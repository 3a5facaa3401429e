"""The ``compilation_config`` that turns the pass on in vLLM.

    vllm serve MODEL -cc "$(python -m dynoff.compile_pass.config)"

or in Python ``LLM(..., compilation_config=dynoff_compilation_config())``. It registers the
pass by import path (resolved by vLLM as ``dynoff.LAYER_PREFETCH_PASS``), turns on Inductor
graph partitioning (the pass sees the whole graph and Inductor cuts CUDA-graph pieces at the
ops) and lists the ops as split points next to vLLM's attention ops (listing
``splitting_ops`` replaces vLLM's defaults, so those must be repeated).
"""

from __future__ import annotations

import json
from typing import Any

from dynoff.compile_pass.ops import OP_NAMES

PASS_PATH = "dynoff.LAYER_PREFETCH_PASS"


def dynoff_compilation_config(base: dict[str, Any] | None = None) -> dict[str, Any]:
    from vllm.config import CompilationConfig

    config = dict(base or {})
    passes = dict(config.get("inductor_passes") or {})
    passes["post_grad_custom_post_pass"] = PASS_PATH
    splitting = list(config.get("splitting_ops") or CompilationConfig._attention_ops)
    splitting += [op for op in OP_NAMES if op not in splitting]
    config.update(
        inductor_passes=passes, use_inductor_graph_partition=True, splitting_ops=splitting
    )
    return config


if __name__ == "__main__":
    print(json.dumps(dynoff_compilation_config()))
