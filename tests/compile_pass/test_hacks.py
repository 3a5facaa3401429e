"""HACK guard: fails when the private vLLM functions the plugin wraps change."""

from __future__ import annotations

import inspect

import torch
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


def test_v2_kv_allocation_signature_call_site_and_swap() -> None:
    import vllm.v1.worker.gpu.attn_utils as attn_utils

    params = list(inspect.signature(attn_utils._allocate_kv_cache).parameters)
    assert params == ["kv_cache_config", "shared_layers", "device"]
    # init_kv_cache looks the allocator up by name in its module at call time.
    source = inspect.getsource(attn_utils.init_kv_cache)
    assert "kv_cache_raw_tensors = _allocate_kv_cache(" in source
    original = attn_utils._allocate_kv_cache
    tensors = {"layers.0.attn": torch.zeros(8, dtype=torch.int8)}
    seen: list[object] = []
    with hacks.kv_allocation_v2(lambda config: seen.append(config) or tensors):
        assert attn_utils._allocate_kv_cache("config", {}, "cpu") is tensors
    assert seen == ["config"]
    assert attn_utils._allocate_kv_cache is original


def _v2_manager(candidates: dict) -> object:
    """vLLM's real V2 ``CudaGraphManager.dispatch`` over hand-made candidates (the manager's
    constructor needs a whole engine; dispatch reads only these four attributes)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    manager = object.__new__(CudaGraphManager)
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0  # type: ignore[attr-defined]
    manager._graphs_captured = True  # type: ignore[attr-defined]
    manager._candidates = candidates  # type: ignore[attr-defined]
    return manager


def test_v2_dispatch_signature_and_steering() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager

    params = list(inspect.signature(CudaGraphManager.dispatch).parameters)
    assert params == ["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"]
    full = BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, uniform_token_count=1)
    pw = BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 8, None)
    # FULL_AND_PIECEWISE: a size's candidates are its FULL decode graph, then its piecewise one.
    manager = _v2_manager({(n, 0): [full, pw] for n in range(1, 9)})
    level = [0]
    seen: list[tuple[bool, bool]] = []
    hacks.steer_cudagraph_manager(manager, lambda: level[0] > 0, lambda *s: seen.append(s))
    assert manager.dispatch(6, 6, 1, 0) == full  # type: ignore[attr-defined]  # k = 0: FULL
    assert manager.dispatch(2, 6, None, 0) == pw  # type: ignore[attr-defined]  # a mixed step
    level[0] = 1
    assert manager.dispatch(6, 6, 1, 0) == pw  # type: ignore[attr-defined]  # k > 0: piecewise
    assert seen == [(False, True), (False, False), (True, False)]  # what the runtime counts
    # FULL-only candidates (no piecewise graph of that size): run compiled, without graphs.
    only_full = _v2_manager({(n, 0): [full] for n in range(1, 9)})
    hacks.steer_cudagraph_manager(only_full, lambda: True)
    desc = only_full.dispatch(6, 6, 1, 0)  # type: ignore[attr-defined]
    assert desc.cg_mode == CUDAGraphMode.NONE and (desc.num_tokens, desc.num_reqs) == (6, 6)


def test_model_memory_usage_is_what_the_memory_profile_counts_as_weights() -> None:
    """7: both runners record the weights' bytes in ``model_memory_usage`` when they load
    the model, and the worker's profile takes it as the weights' memory; the plugin's
    correction lowers it by what it moved, never below zero."""
    import types

    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    profile = inspect.getsource(gpu_worker.Worker.determine_available_memory)
    assert "weights_memory=int(self.model_runner.model_memory_usage)" in profile
    for runner in (GPUModelRunner, v2.GPUModelRunner):
        assert "self.model_memory_usage = m.consumed_memory" in inspect.getsource(runner.load_model)
    runner = types.SimpleNamespace(model_memory_usage=10 << 30)
    assert hacks.take_out_of_model_memory(runner, 4 << 30) == (10 << 30, 6 << 30)
    assert hacks.take_out_of_model_memory(runner, 8 << 30) == (6 << 30, 0)


def test_dummy_run_takes_a_uniform_decode_batch_in_both_runners() -> None:
    """8: the calibration's decode step."""
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for runner in (GPUModelRunner, v2.GPUModelRunner):
        params = inspect.signature(runner._dummy_run).parameters
        assert list(params)[1] == "num_tokens" and "uniform_decode" in params


def test_the_report_rides_on_what_get_output_returns() -> None:
    """9: vLLM's executors materialize an async runner output by calling ``get_output()``;
    the chained function sees the runner's output and its result is what they get."""
    from vllm.v1.executor import multiproc_executor, uniproc_executor
    from vllm.v1.outputs import AsyncModelRunnerOutput

    assert "get_output()" in inspect.getsource(multiproc_executor)
    assert "get_output()" in inspect.getsource(uniproc_executor)

    class Output(AsyncModelRunnerOutput):  # vLLM's abstract contract, made concrete
        def get_output(self):  # type: ignore[no-untyped-def]
            return {"tokens": [7]}

    output = Output()
    hacks.chain_async_output(output, lambda inner: {**inner, "report": "step 3"})
    assert output.get_output() == {"tokens": [7], "report": "step 3"}


def test_v1_cross_layer_kv_allocation_is_declined_on_the_instance_and_v2_never_takes_it() -> None:
    """Hook 10: V1 asks ``self.use_uniform_kv_cache(self.attn_groups)`` (a staticmethod, so
    an instance attribute answers for it) before allocating through hook 1; V2 registers the
    per-layer tensors with the connector and has no cross-layer path."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import kv_connector as v2_connector

    runner_cls = gpu_model_runner.GPUModelRunner
    assert isinstance(inspect.getattr_static(runner_cls, "use_uniform_kv_cache"), staticmethod)
    source = inspect.getsource(runner_cls)
    uniform = source.index("if self.use_uniform_kv_cache(self.attn_groups):")
    assert uniform < source.index("self._allocate_kv_cache_tensors(kv_cache_config)")
    runner = object.__new__(runner_cls)
    hacks.keep_kv_allocation_hooked(runner)
    assert runner.use_uniform_kv_cache([[object()]]) is False
    assert "use_uniform_kv_cache" not in vars(object.__new__(runner_cls))  # per instance only
    v2 = inspect.getsource(v2_connector)
    assert "register_kv_caches(kv_caches_dict)" in v2
    assert "register_cross_layers_kv_cache" not in v2
