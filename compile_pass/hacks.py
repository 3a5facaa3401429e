"""HACK(vllm-0.26.0-private): the only private vLLM functions the plugin wraps.

Written against vLLM 0.26.0; ``tests/compile_pass/test_hacks.py`` fails if any changes.

1. ``GPUModelRunner._allocate_kv_cache_tensors(kv_cache_config) -> {layer: int8 tensor}``
   allocates the KV buffers with ``torch.zeros``. The worker replaces it *on its own runner
   instance* with a function returning VMM-backed tensors (reserved for the largest
   capacity, mostly unmapped, never zero-filled). vLLM has no hook for this.
2. ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)``
   on the CPU platform hands each linear layer's weight to oneDNN (a private packed copy)
   and drops the Parameter. During ``load_model`` only, the worker swaps it for a version
   that keeps the Parameter and computes with ``F.linear`` on it, so the weights can live
   in VMM ranges and be remapped. CPU only; CUDA reads ``param.data`` directly.
3. ``CudagraphDispatcher.dispatch(num_tokens, uniform_decode, has_lora, num_active_loras,
   valid_modes, invalid_modes)``: while any layer is offloaded (k > 0), the worker adds
   ``FULL`` to ``invalid_modes`` on its own runner's dispatcher, so the step replays the
   piecewise graphs and the ops run between pieces; at k = 0 vLLM's FULL decode graphs run
   untouched (the ops were captured in them as no-ops).
4. ``vllm.compilation.backends.split_graph(graph, splitting_ops)``, which ``VllmBackend``
   calls by name on Dynamo's graph when Inductor graph partition is off. For the ``split``
   compilation route (:func:`dynoff.compile_pass.config.dynoff_compilation_config`) the
   plugin wraps it so the layer pass runs on the whole graph first, moving the ops to vLLM's
   own split points (its attention and KV-cache update ops); vLLM then cuts the graph there,
   and Inductor compiles exactly stock vLLM's pieces.
   It acts only when the ops are in ``splitting_ops``: stock runs are untouched.

The V2 model runner (``vllm/v1/worker/gpu/``, vLLM 0.26's default for Qwen3 and Llama) has
its own two places:

5. ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache(kv_cache_config, shared_layers,
   device) -> {layer: int8 tensor}``, which ``attn_utils.init_kv_cache`` calls by name. The
   worker swaps it for VMM-backed tensors for the duration of its own
   ``initialize_from_config`` only (:func:`kv_allocation_v2`).
6. ``CudaGraphManager.dispatch(num_reqs, num_tokens, uniform_token_count,
   num_active_loras) -> BatchExecutionDescriptor``, chosen from the manager's
   priority-ordered ``_candidates`` with ``_is_compatible``. While k > 0 the worker's wrapper
   skips the FULL candidates (:func:`steer_cudagraph_manager`): the step replays the
   piecewise graph of the same size, or runs compiled without graphs if there is none.

Private attributes of the model runners (both):

7. ``model_memory_usage``: the weights' bytes, which the worker's memory profile
   (``Worker.determine_available_memory``, ``weights_memory=``) counts; the plugin takes out
   the bytes it moved into VMM pages (:func:`take_out_of_model_memory`).
8. ``_dummy_run(num_tokens, uniform_decode=True)``: one decode step on dummy inputs through
   the captured graphs; the start-up calibration times it (:func:`dummy_decode`).
9. ``AsyncModelRunnerOutput.get_output()``: the async runner's output is materialized by the
   executor calling it; the worker chains its report onto it (:func:`chain_async_output`).
10. ``GPUModelRunner.use_uniform_kv_cache(attn_groups)`` (V1 runner): with a KV connector that
    prefers cross-layer blocks (vLLM's ``OffloadingConnector`` does), V1 allocates one
    cross-layer KV buffer with ``allocate_uniform_kv_caches``, around hook 1. The worker
    answers False on its own runner instance (:func:`keep_kv_allocation_hooked`), so V1
    allocates through hook 1 and the connector registers those tensors, as it does on the
    V2 runner, which never takes the cross-layer path in 0.26.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

VLLM_VERSION = "0.26.0"


def route_kv_allocation(
    model_runner: Any, allocate: Callable[[Any], dict[str, torch.Tensor]]
) -> None:
    """Make this runner instance allocate its KV tensors with ``allocate``."""
    model_runner._allocate_kv_cache_tensors = allocate


def keep_kv_allocation_hooked(model_runner: Any) -> None:
    """Keep this V1 runner instance off the cross-layer KV allocation (10)."""
    model_runner.use_uniform_kv_cache = lambda attn_groups: False


Observe = Callable[[bool, bool], None]  # (piecewise needed, FULL dispatched)


def steer_cudagraph_dispatch(
    dispatcher: Any, piecewise: Callable[[], bool], observe: Observe | None = None
) -> None:
    """Route steps to the piecewise graphs while ``piecewise()`` (this dispatcher only);
    ``observe`` sees every dispatch (the runtime counts any FULL one that slips through)."""
    from vllm.config import CUDAGraphMode

    original = dispatcher.dispatch

    def dispatch(
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        num_active_loras: int = 0,
        valid_modes: Any = None,
        invalid_modes: Any = None,
    ) -> Any:
        needed = piecewise()
        if needed:
            invalid_modes = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
        result = original(
            num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes
        )
        if observe is not None:
            observe(needed, result[0] == CUDAGraphMode.FULL)
        return result

    dispatcher.dispatch = dispatch


@contextlib.contextmanager
def kv_allocation_v2(allocate: Callable[[Any], dict[str, torch.Tensor]]) -> Iterator[None]:
    """While open, the V2 runner's ``init_kv_cache`` gets its raw KV tensors from
    ``allocate(kv_cache_config)`` (process-wide; the worker opens it around its own
    ``initialize_kv_cache`` call only)."""
    import vllm.v1.worker.gpu.attn_utils as attn_utils

    original = attn_utils._allocate_kv_cache

    def _allocate_kv_cache(kv_cache_config: Any, shared_layers: Any, device: Any) -> Any:
        del shared_layers, device  # the VMM tensors already live on this worker's device
        return allocate(kv_cache_config)

    attn_utils._allocate_kv_cache = _allocate_kv_cache
    try:
        yield
    finally:
        attn_utils._allocate_kv_cache = original


def steer_cudagraph_manager(
    manager: Any, piecewise: Callable[[], bool], observe: Observe | None = None
) -> None:
    """V2 runner: while ``piecewise()``, never pick a FULL graph (this manager only);
    ``observe`` sees every dispatch."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, _is_compatible

    original = manager.dispatch

    def dispatch(
        num_reqs: int, num_tokens: int, uniform_token_count: int | None, num_active_loras: int
    ) -> Any:
        needed = piecewise()
        desc = steered(num_reqs, num_tokens, uniform_token_count, num_active_loras, needed)
        if observe is not None:
            observe(needed, desc.cg_mode == CUDAGraphMode.FULL)
        return desc

    def steered(
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        needed: bool,
    ) -> Any:
        desc = original(num_reqs, num_tokens, uniform_token_count, num_active_loras)
        if desc.cg_mode != CUDAGraphMode.FULL or not needed:
            return desc
        loras = desc.num_active_loras
        for candidate in manager._candidates.get((num_tokens, loras), ()):
            if candidate.cg_mode != CUDAGraphMode.FULL and _is_compatible(
                candidate, num_reqs, num_tokens, uniform_token_count, loras
            ):
                return candidate
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=loras,
        )

    manager.dispatch = dispatch


def run_pass_before_fx_split(layer_pass: Callable[[Any, list[str]], None]) -> None:
    """Make vLLM's FX split run ``layer_pass`` on the whole graph first (idempotent)."""
    import vllm.compilation.backends as backends

    from dynoff.compile_pass.ops import OP_NAMES

    original = backends.split_graph
    if getattr(original, "dynoff_wrapped", False):
        return

    def split_graph(graph: Any, splitting_ops: list[str]) -> Any:
        if any(op in splitting_ops for op in OP_NAMES):
            layer_pass(graph.graph, [op for op in splitting_ops if op not in OP_NAMES])
            graph.recompile()
        return original(graph, splitting_ops)

    split_graph.dynoff_wrapped = True  # type: ignore[attr-defined]
    split_graph.dynoff_original = original  # type: ignore[attr-defined]
    backends.split_graph = split_graph


def _keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
    del remove_weight  # the weight stays: it is what gets relocated
    layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]


@contextlib.contextmanager
def cpu_linear_keeps_weights() -> Iterator[None]:
    import vllm.model_executor.layers.utils as utils

    original = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = _keep_weight
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def take_out_of_model_memory(runner: Any, moved: int) -> tuple[int, int]:
    """Take ``moved`` bytes out of the runner's weights memory (7); (before, after)."""
    before = int(getattr(runner, "model_memory_usage", 0))
    runner.model_memory_usage = max(0, before - moved)
    return before, runner.model_memory_usage


def dummy_decode(runner: Any, batch: int) -> Any:
    """One uniform decode step of ``batch`` requests on dummy inputs (8)."""
    return runner._dummy_run(batch, uniform_decode=True)


def chain_async_output(output: Any, then: Callable[[Any], Any]) -> None:
    """Make ``output.get_output()`` return ``then(<the runner's output>)`` (9)."""
    inner = output.get_output
    output.get_output = lambda: then(inner())
