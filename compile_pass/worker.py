"""``--worker-cls dynoff.compile_pass.worker.DynamicOffloadWorker`` (CUDA).

Imports nothing of vLLM's CPU worker (which patches ``torch.cuda`` on import)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from dynoff.compile_pass.worker_base import DynamicOffloadMixin


class DynamicOffloadWorker(DynamicOffloadMixin, Worker):
    """vLLM's CUDA worker with dynamic offloading (see :mod:`.worker_base`)."""
