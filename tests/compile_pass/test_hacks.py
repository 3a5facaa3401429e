"""HACK guard: fails when the private vLLM functions the plugin wraps change."""

from __future__ import annotations

import inspect

import vllm

from dynoff.compile_pass import hacks


def test_written_against_this_vllm() -> None:
    assert vllm.__version__.startswith(hacks.VLLM_VERSION), (
        f"hacks.py was written against vLLM {hacks.VLLM_VERSION}, found {vllm.__version__}: "
        "re-check both wrapped functions, then update VLLM_VERSION"
    )


def test_kv_allocation_hook_signature() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = list(inspect.signature(GPUModelRunner._allocate_kv_cache_tensors).parameters)
    assert params == ["self", "kv_cache_config"]
    source = inspect.getsource(GPUModelRunner)
    assert "self._allocate_kv_cache_tensors(kv_cache_config)" in source


def test_cpu_linear_dispatch_signature_and_call_site() -> None:
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.utils as utils

    params = list(inspect.signature(utils.dispatch_cpu_unquantized_gemm).parameters)
    assert params == ["layer", "remove_weight"]
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in inspect.getsource(linear)
    with hacks.cpu_linear_keeps_weights():
        assert utils.dispatch_cpu_unquantized_gemm is hacks._keep_weight
    assert utils.dispatch_cpu_unquantized_gemm is not hacks._keep_weight
