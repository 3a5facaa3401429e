"""Worker classes for vLLM's CPU engine (CI, the README's main job).

``--worker-cls dynoff.compile_pass.cpu_worker.CPUDynamicOffloadWorker``. Kept apart from the
CUDA worker: importing vLLM's CPU worker patches ``torch.cuda`` process-wide."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from dynoff.compile_pass import hacks
from dynoff.compile_pass.worker_base import DynamicOffloadMixin


class CPUDynamicOffloadWorker(DynamicOffloadMixin, CPUWorker):
    """vLLM's CPU worker with dynamic offloading (see :mod:`.worker_base`)."""


class CPUReferenceWorker(CPUWorker):
    """vLLM's CPU worker with only the plugin's linear-layer path (no offloading): the
    baseline the CPU token-identity tests compare against, since the plugin's CPU path
    computes linears with ``F.linear`` on the Parameter rather than oneDNN's packed copy."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with hacks.cpu_linear_keeps_weights():
            super().load_model(*args, **kwargs)
