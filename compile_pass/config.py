"""The ``compilation_config`` that turns the pass on in vLLM, for each compilation route.

    vllm serve MODEL -cc "$(python -m dynoff.compile_pass.config)"                   # split
    vllm serve MODEL -cc "$(python -m dynoff.compile_pass.config --route partition)"

or in Python ``LLM(..., compilation_config=dynoff_compilation_config())``.

* ``split`` (the default on GPU): Inductor partitioning stays off, as in stock vLLM; the ops
  are listed as split points and the pass runs on Dynamo's graph just before vLLM's FX split
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
* ``inductor`` (the default on vLLM's CPU engine, which compiles one Inductor graph without
  vLLM's backend and FX split): the pass is Inductor's post-grad custom pass, no split points.

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
Route = Literal["split", "partition", "inductor"]
ROUTES = ("split", "partition", "inductor")


def default_route() -> Route:
    """``inductor`` on vLLM's CPU engine, ``split`` everywhere else."""
    from vllm.platforms import current_platform

    return "inductor" if current_platform.is_cpu() else "split"


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
    base: dict[str, Any] | None = None, route: Route | None = None
) -> dict[str, Any]:
    """``base`` (a ``compilation_config`` dict: the operator's own settings, e.g. capture
    sizes) with the plugin's route added; ``route`` defaults to :func:`default_route` for
    the platform vLLM runs on. A setting in ``base`` the route would have to overwrite is
    refused rather than dropped: another post-grad pass, or graph partitioning against the
    route. ``splitting_ops`` in ``base`` replace stock's, and the plugin's ops are added."""
    route = route or default_route()
    if route not in ROUTES:
        raise ValueError(f"route={route!r}: use one of {ROUTES}")
    config = dict(base or {})
    theirs = (config.get("inductor_passes") or {}).get("post_grad_custom_post_pass")
    if theirs not in (None, PASS_PATH, MARKER_PATH):
        raise ValueError(
            f"inductor_passes.post_grad_custom_post_pass={theirs!r}: the plugin's layer pass "
            "takes Inductor's one post-grad custom pass; drop yours from the base config"
        )
    partition = config.get("use_inductor_graph_partition")
    if partition is not None and bool(partition) != (route == "partition"):
        raise ValueError(
            f"use_inductor_graph_partition={partition} contradicts route {route!r}: leave it "
            "out and choose the route (--route partition for Inductor's graph partitioning)"
        )
    if route == "inductor":  # one Inductor graph: the pass post-grad, no split points
        passes = dict(config.get("inductor_passes") or {})
        passes["post_grad_custom_post_pass"] = PASS_PATH
        config["inductor_passes"] = passes
        return config
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
    """The route a vLLM ``CompilationConfig`` (as the worker sees it, after the platform has
    adjusted it) sets up, or None when the ops would never be inserted in the whole graph
    (offloaded layers would then run on another layer's weights)."""
    from vllm.config import CompilationMode

    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS

    splitting = set(compilation_config.splitting_ops or ())
    key = "post_grad_custom_post_pass"
    named = (compilation_config.inductor_passes or {}).get(key)
    resolved = (compilation_config.inductor_compile_config or {}).get(key)
    has_pass = named == PASS_PATH or resolved is LAYER_PREFETCH_PASS
    if compilation_config.mode != CompilationMode.VLLM_COMPILE:
        # No vLLM backend, so no FX split (vLLM's CPU engine compiles one Inductor graph):
        # only the post-grad pass sees the whole graph.
        return "inductor" if has_pass else None
    if compilation_config.use_inductor_graph_partition:
        return "partition" if has_pass and set(OP_NAMES) <= splitting else None
    # vLLM's backend splits the graph; the post-grad pass alone would see only pieces.
    return "split" if set(OP_NAMES) <= splitting else None


def _logs_to_stderr() -> None:
    """vLLM logs to stdout; the JSON printed here is read by ``-cc "$(...)"``, so importing
    vLLM (its platform and Triton checks log at import) must not write there."""
    import logging
    import os
    import sys

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM not imported yet
    for handler in logging.getLogger("vllm").handlers:  # or it was, by an earlier import
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def main() -> None:
    _logs_to_stderr()
    parser = argparse.ArgumentParser(description="Print the plugin's compilation_config JSON.")
    parser.add_argument("--route", choices=ROUTES, default=None, help="default: per platform")
    parser.add_argument(
        "--base",
        default=None,
        metavar="JSON",
        help="your own compilation_config (what you would pass to -cc), to which the "
        "plugin's route is added, e.g. '{\"cudagraph_capture_sizes\": [1, 8, 64, 256]}'",
    )
    args = parser.parse_args()
    try:
        base = json.loads(args.base) if args.base else None
        if base is not None and not isinstance(base, dict):
            raise ValueError(f"--base must be a JSON object, got {type(base).__name__}")
        print(json.dumps(dynoff_compilation_config(base, route=args.route)))
    except ValueError as e:  # json.JSONDecodeError included
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
