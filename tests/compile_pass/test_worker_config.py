"""GPU configurations the worker refuses at start-up, with the reason."""

from __future__ import annotations

import types

import pytest
from vllm.config import CUDAGraphMode

from dynoff.compile_pass.worker_base import check_gpu_config


def config(sleep: bool = False, mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enable_sleep_mode=sleep),
        compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
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
