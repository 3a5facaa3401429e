"""``vllm.general_plugins`` entry point, run in every vLLM process: registers the custom ops
and, for the ``split`` compilation route, makes vLLM's FX split run the layer pass first.
The split hook acts only when the ops are in ``splitting_ops``; other runs are untouched."""

from __future__ import annotations


def register() -> None:
    import dynoff.compile_pass.ops  # noqa: F401  (registers dynoff::wait_layer / prefetch_layer)
    from dynoff.compile_pass import hacks
    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS

    hacks.run_pass_before_fx_split(LAYER_PREFETCH_PASS)
