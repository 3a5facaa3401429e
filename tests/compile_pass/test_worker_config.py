"""Configurations the worker refuses at start-up, with the reason and the fix."""

from __future__ import annotations

import types

import pytest
from vllm.config import CUDAGraphMode

from dynoff.compile_pass.worker_base import check_features, check_gpu_config, check_kv_connector


def config(
    sleep: bool = False,
    mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE,
    dp: int = 1,
    kv_dtype: str = "auto",
):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=sleep),
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
        parallel_config=types.SimpleNamespace(data_parallel_size=dp),
        cache_config=types.SimpleNamespace(cache_dtype=kv_dtype),
    )


def test_default_and_piecewise_modes_are_accepted() -> None:
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        check_gpu_config(config(mode=mode))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY])
def test_modes_without_piecewise_graphs_are_refused(mode: CUDAGraphMode) -> None:
    with pytest.raises(ValueError, match=f"cudagraph_mode={mode.name}"):
        check_gpu_config(config(mode=mode))


def test_sleep_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        check_gpu_config(config(sleep=True))


def test_data_parallelism_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=2.*one vllm serve per replica"):
        check_gpu_config(config(dp=2))


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_is_refused_with_the_fix(kv_dtype: str) -> None:
    with pytest.raises(ValueError, match=rf"kv_cache_dtype={kv_dtype}.*--kv-cache-dtype auto"):
        check_gpu_config(config(kv_dtype=kv_dtype))
    check_gpu_config(config(kv_dtype="bfloat16"))  # a non-fp8 KV dtype passes


@pytest.mark.parametrize("connector", ["LMCacheConnectorV1", "NixlConnector", "ExampleConnector"])
def test_a_kv_connector_other_than_vllms_cpu_offloading_is_refused_with_the_fix(
    connector: str,
) -> None:
    """Item 6 of the hardening issue: a connector that registers or allocates the KV cache
    in ways not shown to survive the levels' remapping is refused. vLLM's own config object,
    as the CLI builds it."""
    from vllm.config import KVTransferConfig, VllmConfig

    with_connector = VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    )
    with pytest.raises(ValueError, match=rf"kv_connector={connector}.*--kv-offloading-size N"):
        check_kv_connector(with_connector)
    check_kv_connector(VllmConfig())  # no connector: accepted


def test_speculative_decoding_is_refused_with_the_fix() -> None:
    """A draft model would be compiled with the offload ops; every method changes the step
    shapes the policy prices. vLLM's own config objects, as the CLI builds them."""
    from vllm.config import SpeculativeConfig

    ngram = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2
    )
    served = types.SimpleNamespace(speculative_config=ngram, lora_config=None, model_config=None)
    with pytest.raises(ValueError, match=r"speculative decoding \(ngram\).*--speculative-config"):
        check_features(served)
    check_features(types.SimpleNamespace(speculative_config=None, lora_config=None))  # none set


def test_lora_is_refused_with_the_fix() -> None:
    """Adapters are written into the layers while serving; their host copies never see it."""
    from vllm.config import LoRAConfig

    served = types.SimpleNamespace(
        speculative_config=None, lora_config=LoRAConfig(), model_config=None
    )
    with pytest.raises(ValueError, match=r"LoRA.*drop --enable-lora"):
        check_features(served)


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq_marlin"])
def test_a_quantized_model_is_refused_with_the_fix(method: str) -> None:
    """Untested: a method may keep weights or scales outside the layers' parameters. An
    unquantized model (``quantization`` unset) passes."""
    served = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=method))
    with pytest.raises(ValueError, match=rf"quantization={method}.*unquantized checkpoint"):
        check_features(served)
    check_features(types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None)))


@pytest.mark.parametrize(
    "offload",
    [{"uva": {"cpu_offload_gb": 8}}, {"prefetch": {"offload_group_size": 8}}],
    ids=["uva", "prefetch"],
)
def test_vllms_own_weight_offloading_is_refused_with_the_fix(offload: dict) -> None:
    """``--cpu-offload-gb`` and ``--offload-group-size`` move the layers the plugin packs.
    vLLM's own config object; its default (no offloading) passes."""
    from vllm.config import OffloadConfig

    served = types.SimpleNamespace(offload_config=OffloadConfig(**offload))
    with pytest.raises(ValueError, match=r"--cpu-offload-gb.*drop those flags"):
        check_features(served)
    check_features(types.SimpleNamespace(offload_config=OffloadConfig()))


def test_vllms_cpu_kv_offloading_is_accepted() -> None:
    """The CPU KV tier issue: ``--kv-offloading-size`` (vLLM makes it an
    ``OffloadingConnector``) and the connector named outright both pass; the simple one,
    which keeps its own view of the GPU block pool, does not."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    offloading = VllmConfig(cache_config=CacheConfig(kv_offloading_size=4.0))
    assert offloading.kv_transfer_config.kv_connector == "OffloadingConnector"
    check_kv_connector(offloading)
    named = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    check_kv_connector(VllmConfig(kv_transfer_config=named))
    simple = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match="VLLM_USE_SIMPLE_KV_OFFLOAD unset"):
        check_kv_connector(VllmConfig(kv_transfer_config=simple))


def test_gpu_worker_module_leaves_torch_cuda_alone() -> None:
    """Importing vLLM's CPU worker replaces torch.cuda.Event process-wide; the CUDA worker
    module must not import it (that broke Inductor's autotuning on the H200)."""
    import subprocess
    import sys

    code = (
        "import torch, sys\n"
        "event = torch.cuda.Event\n"
        "import dynoff.compile_pass.worker\n"
        "assert 'vllm.v1.worker.cpu_worker' not in sys.modules\n"
        "assert torch.cuda.Event is event\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
