"""The ``compilation_config`` that turns the pass on in vLLM, for either compilation route.

    vllm serve MODEL -cc "$(python -m dynoff.compile_pass.config)"                   # split
    vllm serve MODEL -cc "$(python -m dynoff.compile_pass.config --route partition)"

or in Python ``LLM(..., compilation_config=dynoff_compilation_config())``.

* ``split`` (default): Inductor partitioning stays off, as in stock vLLM; the ops are listed
  as split points and the pass runs on Dynamo's graph just before vLLM's FX split
  (:func:`dynoff.compile_pass.hacks.run_pass_before_fx_split`), so the pieces between split
  points are compiled exactly as stock vLLM compiles its pieces. A no-op post-grad pass
  (``dynoff.SPLIT_ROUTE_MARKER``) carries the pass's ``uuid()`` into vLLM's cache key.
  On the H200 (Qwen3-8B) it runs at 0.996x stock throughput at k = 0.
* ``partition``: the pass is registered by import path as Inductor's post-grad
  custom pass (resolved by vLLM as ``dynoff.LAYER_PREFETCH_PASS``), Inductor graph
  partitioning is on (the pass sees the whole graph, Inductor cuts CUDA-graph pieces at the
  ops), and the ops are listed as split points next to vLLM's attention ops. Inductor
  partitioning alone (no pass, no plugin) costs 2.4% of stock throughput on the H200, so this
  route is kept for vLLM versions whose FX split the ``split`` route's hook no longer fits.

Listing ``splitting_ops`` replaces vLLM's defaults, so those are repeated exactly
(:func:`stock_splitting_ops`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Literal

from dynoff.compile_pass.ops import OP_NAMES

PASS_PATH = "dynoff.LAYER_PREFETCH_PASS"
MARKER_PATH = "dynoff.SPLIT_ROUTE_MARKER"
Route = Literal["partition", "split"]
ROUTES = ("partition", "split")


# With Inductor partitioning off, stock vLLM 0.26 also splits at the KV-cache update ops
# (``CompilationConfig.set_splitting_ops_for_v1``, when ``splitting_ops`` is left unset).
KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")


def stock_splitting_ops(route: Route) -> list[str]:
    """The split points stock vLLM 0.26 chooses by itself for this route's partitioning mode.

    Listing ``splitting_ops`` replaces vLLM's default instead of extending it, so the default
    is repeated here exactly, and the pieces between split points are stock's own pieces cut
    only at our ops. (On the H200 the KV-cache update split points changed no output token
    of Qwen3-8B at k = 0; they are stock's pieces, and they keep the KV write out of them.)"""
    from vllm.config import CompilationConfig

    ops = list(CompilationConfig._attention_ops)
    if route == "split":
        ops += [op for op in KV_CACHE_UPDATE_OPS if op not in ops]
    return ops


def dynoff_compilation_config(
    base: dict[str, Any] | None = None, route: Route = "split"
) -> dict[str, Any]:
    if route not in ROUTES:
        raise ValueError(f"route={route!r}: use one of {ROUTES}")
    config = dict(base or {})
    splitting = list(config.get("splitting_ops") or stock_splitting_ops(route))
    splitting += [op for op in OP_NAMES if op not in splitting]
    passes = dict(config.get("inductor_passes") or {})
    # route split: the marker only puts the pass's uuid into vLLM's compile-cache key
    passes["post_grad_custom_post_pass"] = PASS_PATH if route == "partition" else MARKER_PATH
    config.update(
        splitting_ops=splitting,
        inductor_passes=passes,
        use_inductor_graph_partition=route == "partition",
    )
    return config


def compile_route(compilation_config: Any) -> Route | None:
    """The route a vLLM ``CompilationConfig`` sets up, or None when the ops would never be
    inserted (offloading would then run layers on another layer's weights)."""
    splitting = set(compilation_config.splitting_ops or ())
    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS

    key = "post_grad_custom_post_pass"
    named = (compilation_config.inductor_passes or {}).get(key)
    resolved = (compilation_config.inductor_compile_config or {}).get(key)
    has_pass = named == PASS_PATH or resolved is LAYER_PREFETCH_PASS
    if compilation_config.use_inductor_graph_partition:
        return "partition" if has_pass and set(OP_NAMES) <= splitting else None
    if set(OP_NAMES) <= splitting:
        return "split"
    return "partition" if has_pass else None  # CPU: one Inductor graph, no split points


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the plugin's compilation_config JSON.")
    parser.add_argument("--route", choices=ROUTES, default="split")
    print(json.dumps(dynoff_compilation_config(route=parser.parse_args().route)))


if __name__ == "__main__":
    main()
