"""The compilation_config helper and the string path vLLM resolves."""

from __future__ import annotations

import pytest
from vllm.config import CompilationConfig

from dynoff.compile_pass.config import MARKER_PATH, PASS_PATH, dynoff_compilation_config
from dynoff.compile_pass.fx_pass import LayerPrefetchPass
from dynoff.compile_pass.worker_base import check_compile_config


@pytest.mark.parametrize("route", ["partition", "split"])
def test_config_keeps_attention_split_points_and_adds_ours(route: str) -> None:
    config = dynoff_compilation_config(route=route)
    assert config["use_inductor_graph_partition"] is (route == "partition")
    assert set(CompilationConfig._attention_ops) <= set(config["splitting_ops"])
    assert {"dynoff::wait_layer", "dynoff::prefetch_layer"} <= set(config["splitting_ops"])


def test_default_route_follows_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU: split (measured on the H200: stock speed at k = 0, 0.996x; partition 0.976x).
    vLLM's CPU engine (this machine) compiles one Inductor graph: the post-grad pass."""
    from vllm.platforms import current_platform

    from dynoff.compile_pass.config import default_route

    assert current_platform.is_cpu() and default_route() == "inductor"
    assert dynoff_compilation_config() == dynoff_compilation_config(route="inductor")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    assert default_route() == "split"
    default = CompilationConfig(**dynoff_compilation_config(), mode=3)
    assert check_compile_config(default) == "split"


def test_vllm_resolves_the_pass_from_its_import_path() -> None:
    # vLLM's own resolution: __import__(module).__dict__[name] on the top-level package.
    module, name = PASS_PATH.rsplit(".", 1)
    assert isinstance(__import__(module).__dict__[name], LayerPrefetchPass)
    resolved = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": PASS_PATH})
    assert isinstance(
        resolved.inductor_compile_config["post_grad_custom_post_pass"], LayerPrefetchPass
    )


@pytest.mark.parametrize("route", ["partition", "split"])
def test_both_routes_are_recognised_in_vllms_own_config(route: str) -> None:
    config = CompilationConfig(**dynoff_compilation_config(route=route), mode=3)
    assert check_compile_config(config) == route


def test_a_config_without_the_pass_is_refused() -> None:
    with pytest.raises(ValueError, match="needs its layer pass"):
        check_compile_config(CompilationConfig(mode=3, use_inductor_graph_partition=True))
    with pytest.raises(ValueError, match="enforce-eager"):
        check_compile_config(CompilationConfig(mode=0))


def test_each_route_only_where_it_sees_the_whole_graph() -> None:
    """vLLM's CPU engine compiles without vLLM's backend (mode DYNAMO_TRACE_ONCE, no FX
    split): there the split route's hook never runs, so only the post-grad pass counts. Under
    vLLM's backend without Inductor partitioning the post-grad pass sees only pieces."""
    from vllm.config import CompilationMode

    once = CompilationMode.DYNAMO_TRACE_ONCE
    inductor = CompilationConfig(**dynoff_compilation_config(route="inductor"), mode=once)
    assert check_compile_config(inductor) == "inductor"
    split_on_cpu = CompilationConfig(**dynoff_compilation_config(route="split"), mode=once)
    inductor_on_gpu = CompilationConfig(
        **dynoff_compilation_config(route="inductor"), mode=CompilationMode.VLLM_COMPILE
    )
    for config in (split_on_cpu, inductor_on_gpu):
        with pytest.raises(ValueError, match="needs its layer pass"):
            check_compile_config(config)


def test_split_route_carries_the_pass_uuid_into_the_cache_key() -> None:
    from dynoff.compile_pass.config import MARKER_PATH
    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS, SplitRouteMarker

    resolved = CompilationConfig(**dynoff_compilation_config(route="split"))
    marker = resolved.inductor_compile_config["post_grad_custom_post_pass"]
    assert isinstance(marker, SplitRouteMarker)
    assert marker.uuid() == LAYER_PREFETCH_PASS.uuid()
    assert resolved.inductor_passes["post_grad_custom_post_pass"] == MARKER_PATH


@pytest.mark.parametrize("route", ["partition", "split"])
def test_split_points_are_stocks_plus_ours(route: str) -> None:
    """Stock vLLM's own split points, exactly, then ours: the pieces are stock's pieces, cut
    only at our ops."""
    from dynoff.compile_pass.config import KV_CACHE_UPDATE_OPS, stock_splitting_ops
    from dynoff.compile_pass.ops import OP_NAMES

    splitting = dynoff_compilation_config(route=route)["splitting_ops"]
    assert splitting == stock_splitting_ops(route) + list(OP_NAMES)
    kv_cache_ops = set(KV_CACHE_UPDATE_OPS) & set(splitting)
    assert kv_cache_ops == (set(KV_CACHE_UPDATE_OPS) if route == "split" else set())


def test_stock_default_split_points_match_vllm() -> None:
    """What vLLM 0.26 itself sets when ``splitting_ops`` is unset: the attention ops, plus the
    KV-cache update ops with Inductor partitioning off. Fails when vLLM's default changes."""
    from vllm.config import CompilationConfig, CompilationMode

    from dynoff.compile_pass.config import stock_splitting_ops

    for partition, route in ((False, "split"), (True, "partition")):
        stock = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, use_inductor_graph_partition=partition
        )
        stock.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
        assert stock.splitting_ops == stock_splitting_ops(route)


@pytest.mark.parametrize("changed", ["pairing", "ops", "fx_pass", "hacks"])
def test_the_pass_uuid_changes_with_any_source_that_shapes_its_output(
    changed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pairing decides which layer's prefetch sits where, the ops are what it inserts,
    # the module's helpers place them and the split hook decides which graph they go in;
    # a uuid of the class body alone would let a cache keep a graph built by older code.
    import inspect

    from dynoff.compile_pass import fx_pass, hacks, ops, pairing

    target = {
        "pairing": pairing,
        "ops": ops,
        "fx_pass": fx_pass,
        "hacks": hacks.run_pass_before_fx_split,
    }[changed]
    before = LayerPrefetchPass().uuid()
    original = inspect.getsource

    def edited(obj: object) -> str:
        return original(obj) + ("\n# edited" if obj is target else "")

    monkeypatch.setattr(inspect, "getsource", edited)
    assert LayerPrefetchPass().uuid() != before


@pytest.mark.parametrize("route", ["partition", "split", "inductor"])
def test_an_operators_own_settings_are_kept_and_conflicts_refused(route: str) -> None:
    """``--base``: the operator's own compilation settings go through with the route added;
    what the route would have to overwrite is refused with the fix, not dropped."""
    import json
    import subprocess
    import sys

    base = {"cudagraph_capture_sizes": [1, 8, 64], "inductor_passes": {"other": "x"}}
    config = dynoff_compilation_config(base, route=route)
    assert config["cudagraph_capture_sizes"] == [1, 8, 64]
    assert config["inductor_passes"]["other"] == "x"
    assert config["inductor_passes"]["post_grad_custom_post_pass"] in (PASS_PATH, MARKER_PATH)
    theirs = {"inductor_passes": {"post_grad_custom_post_pass": "mine.PASS"}}
    with pytest.raises(ValueError, match="drop yours"):
        dynoff_compilation_config(theirs, route=route)
    cli = [sys.executable, "-m", "dynoff.compile_pass.config", "--route", route, "--base"]
    printed = subprocess.run([*cli, json.dumps(base)], capture_output=True, text=True, check=True)
    assert json.loads(printed.stdout) == config
    refused = subprocess.run([*cli, json.dumps(theirs)], capture_output=True, text=True)
    assert refused.returncode == 2 and "drop yours" in refused.stderr


@pytest.mark.parametrize("route", ["partition", "split", "inductor"])
def test_the_printed_config_is_the_only_thing_on_stdout(route: str) -> None:
    """The README's ``-cc "$(python -m dynoff.compile_pass.config)"`` reads stdout whole:
    vLLM's import-time log lines (it logs to stdout) must go elsewhere."""
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "dynoff.compile_pass.config", "--route", route]
    printed = subprocess.run(cli, capture_output=True, text=True, check=True)
    assert json.loads(printed.stdout) == dynoff_compilation_config(route=route)


def test_partitioning_against_the_route_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="--route partition"):
        dynoff_compilation_config({"use_inductor_graph_partition": True}, route="split")
    with pytest.raises(ValueError, match="contradicts route 'partition'"):
        dynoff_compilation_config({"use_inductor_graph_partition": False}, route="partition")
    kept = dynoff_compilation_config({"use_inductor_graph_partition": True}, route="partition")
    assert kept["use_inductor_graph_partition"] is True
