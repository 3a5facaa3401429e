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


def test_dispatch_signature_and_steering() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    params = list(inspect.signature(CudagraphDispatcher.dispatch).parameters)
    assert params == [
        "self",
        "num_tokens",
        "uniform_decode",
        "has_lora",
        "num_active_loras",
        "valid_modes",
        "invalid_modes",
    ]

    class Recorder:
        def __init__(self) -> None:
            self.calls: list = []

        def dispatch(self, *args: object) -> object:
            self.calls.append(args)
            return args

    level = [0]
    recorder = Recorder()
    hacks.steer_cudagraph_dispatch(recorder, lambda: level[0] > 0)
    recorder.dispatch(8, True)
    assert recorder.calls[-1][-1] is None  # k = 0: vLLM decides (FULL decode graphs)
    level[0] = 2
    recorder.dispatch(8, True, False, 0, None, {CUDAGraphMode.NONE})
    assert recorder.calls[-1][-1] == {CUDAGraphMode.NONE, CUDAGraphMode.FULL}


def test_fx_split_signature_and_call_site() -> None:
    import vllm.compilation.backends as backends

    params = list(inspect.signature(backends.split_graph).parameters)
    assert params == ["graph", "splitting_ops"]
    # VllmBackend looks split_graph up by name in its module at call time, on Dynamo's graph.
    source = inspect.getsource(backends.VllmBackend.__call__)
    assert "split_graph(graph, fx_split_ops)" in source
    assert "fx_split_ops: list[str] = []" in source  # partition on: no FX split points
