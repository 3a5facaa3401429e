"""The compilation_config helper and the string path vLLM resolves."""

from __future__ import annotations

from vllm.config import CompilationConfig

from dynoff.compile_pass.config import PASS_PATH, dynoff_compilation_config
from dynoff.compile_pass.fx_pass import LayerPrefetchPass


def test_config_keeps_attention_split_points_and_adds_ours() -> None:
    config = dynoff_compilation_config()
    assert config["use_inductor_graph_partition"] is True
    assert set(CompilationConfig._attention_ops) <= set(config["splitting_ops"])
    assert {"dynoff::wait_layer", "dynoff::prefetch_layer"} <= set(config["splitting_ops"])


def test_vllm_resolves_the_pass_from_its_import_path() -> None:
    # vLLM's own resolution: __import__(module).__dict__[name] on the top-level package.
    module, name = PASS_PATH.rsplit(".", 1)
    assert isinstance(__import__(module).__dict__[name], LayerPrefetchPass)
    resolved = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": PASS_PATH})
    assert isinstance(
        resolved.inductor_compile_config["post_grad_custom_post_pass"], LayerPrefetchPass
    )
