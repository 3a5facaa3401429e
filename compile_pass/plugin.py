"""``vllm.general_plugins`` entry point: registers the custom ops in every vLLM process."""

from __future__ import annotations


def register() -> None:
    import dynoff.compile_pass.ops  # noqa: F401  (registers dynoff::wait_layer / prefetch_layer)
