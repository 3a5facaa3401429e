"""GPU configurations the worker refuses at start-up, with the reason."""

from __future__ import annotations

import types

import pytest
from vllm.config import CUDAGraphMode

from dynoff.compile_pass.worker import check_gpu_config


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
