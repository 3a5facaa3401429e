"""Route ``split`` on the toy decoder (N = 8): the pass runs on Dynamo's graph, then vLLM's own
FX split (``vllm.compilation.backends.split_graph``, wrapped by the HACK) cuts the graph at the
attention op and at ours, as ``VllmBackend`` does without Inductor partitioning.

Proves: the pass works on Dynamo-level graphs (``call_method`` nodes, ``example_value``
metadata); every op becomes an eager piece (or shares one with its neighbour op), in layer
order, and no compiled piece holds one; outputs equal eager at every depth, with no
recompilation; and stock splitting (without our ops listed) is left alone."""

from __future__ import annotations

import pytest
import torch
import vllm.compilation.backends as backends
from torch import fx

from dynoff.compile_pass import hacks
from dynoff.compile_pass.fx_pass import LayerPrefetchPass
from dynoff.compile_pass.ops import OP_NAMES, PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner
from tests.compile_pass.test_toy_decoder import N, Offloaded

ATTENTION = "dynoff_toy::attention"


class SplitBackend:
    """What ``VllmBackend`` does with partitioning off: split, then run the pieces."""

    def __init__(self, splitting_ops: list[str]) -> None:
        self.splitting_ops = splitting_ops
        self.calls = 0
        self.items: list = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        self.calls += 1
        split_gm, self.items = backends.split_graph(gm, self.splitting_ops)
        return split_gm


def vllm_split_graph():
    """vLLM's own function, even when the plugin has already wrapped it in this process."""
    return getattr(backends.split_graph, "dynoff_original", backends.split_graph)


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> LayerPrefetchPass:
    monkeypatch.setattr(backends, "split_graph", vllm_split_graph())  # restored afterwards
    layer_pass = LayerPrefetchPass()
    hacks.run_pass_before_fx_split(layer_pass)
    wrapper = backends.split_graph
    hacks.run_pass_before_fx_split(layer_pass)  # idempotent: wraps once
    assert backends.split_graph is wrapper
    torch._dynamo.reset()
    return layer_pass


def ops_in(item) -> list[tuple[object, int]]:
    return [
        (node.target, node.args[1])
        for node in item.graph.graph.nodes
        if node.target in (WAIT, PREFETCH)
    ]


def test_layer_boundaries_become_eager_pieces(wrapped: LayerPrefetchPass) -> None:
    rig = Offloaded()
    try:
        backend = SplitBackend([ATTENTION, *OP_NAMES])
        compiled = torch.compile(rig.model, backend=backend)
        torch.testing.assert_close(compiled(rig.x), rig.reference)
        # In order: wait(0), then per layer the partner's prefetch and the next layer's
        # wait. (The toy's residual add sits between them; in vLLM's models it belongs to the
        # next layer's fused add-norm, and the two ops share one piece.)
        pieces = [ops_in(i) for i in backend.items if i.is_splitting_graph and ops_in(i)]
        expected = [(WAIT, 0)]
        for layer in range(N):
            expected.append((PREFETCH, partner(layer, N)))
            expected += [(WAIT, layer + 1)] if layer + 1 < N else []
        assert [op for piece in pieces for op in piece] == expected
        attention = [i for i in backend.items if i.is_splitting_graph and not ops_in(i)]
        assert len(attention) == N
        # Every piece between split points is ordinary compute, free of our ops.
        assert all(not ops_in(i) for i in backend.items if not i.is_splitting_graph)
    finally:
        rig.close()


def test_outputs_equal_eager_at_every_level_without_recompiling(
    wrapped: LayerPrefetchPass,
) -> None:
    rig = Offloaded()
    try:
        backend = SplitBackend([ATTENTION, *OP_NAMES])
        compiled = torch.compile(rig.model, backend=backend)
        compiled(rig.x)
        for level in [1, 2, 4, 3, 0, 4, 1, 0]:
            rig.set_level(level)
            for _ in range(2):
                torch.testing.assert_close(compiled(rig.x), rig.reference, msg=f"level {level}")
        assert backend.calls == 1
        assert rig.runtime.calls["prefetch"] > 0 and rig.runtime.calls["wait"] > 0
    finally:
        rig.close()


def test_stock_splitting_is_left_alone(wrapped: LayerPrefetchPass) -> None:
    rig = Offloaded()
    try:
        backend = SplitBackend([ATTENTION])
        torch.compile(rig.model, backend=backend)(rig.x)
        assert not any(ops_in(i) for i in backend.items)
        assert wrapped.invocations == 0
    finally:
        rig.close()


def test_the_vllm_plugin_installs_the_split_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM runs general plugins in every process before it compiles, so the ``split`` route
    works with or without the plugin's worker (the ops are then inserted and do nothing)."""
    from dynoff.compile_pass import plugin
    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS

    original = vllm_split_graph()
    monkeypatch.setattr(backends, "split_graph", original)
    plugin.register()
    assert getattr(backends.split_graph, "dynoff_wrapped", False)
    assert backends.split_graph.dynoff_original is original
    before = LAYER_PREFETCH_PASS.invocations
    rig = Offloaded()
    try:
        torch._dynamo.reset()
        backend = SplitBackend([ATTENTION])  # stock splitting: the pass stays out of it
        torch.compile(rig.model, backend=backend)(rig.x)
        assert LAYER_PREFETCH_PASS.invocations == before
    finally:
        rig.close()
