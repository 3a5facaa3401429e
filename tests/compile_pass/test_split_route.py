"""Route ``split`` on the toy decoder (N = 8): the pass runs on Dynamo's graph, then vLLM's own
FX split (``vllm.compilation.backends.split_graph``, wrapped by the HACK) cuts the graph at the
attention op and at ours, as ``VllmBackend`` does without Inductor partitioning.

Proves: the pass works on Dynamo-level graphs (``call_method`` nodes, ``example_value``
metadata); the ops move to vLLM's split points, so every piece Inductor compiles is one of
stock's, and none holds an op; a pair too close for that keeps the layer boundaries;
outputs equal eager at every depth, with no recompilation; and stock splitting (without
our ops listed) is left alone."""

from __future__ import annotations

import pytest
import torch
import vllm.compilation.backends as backends
from torch import fx
from vllm.compilation.partition_rules import should_split

from dynoff.compile_pass import hacks
from dynoff.compile_pass.fx_pass import LayerPrefetchPass
from dynoff.compile_pass.ops import OP_NAMES, PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner
from tests.compile_pass.test_toy_decoder import N, Offloaded
from tests.compile_pass.toy_model import ToyDecoder

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


def test_ops_move_to_vllms_split_points(wrapped: LayerPrefetchPass) -> None:
    rig = Offloaded()
    try:
        backend = SplitBackend([ATTENTION, *OP_NAMES])
        compiled = torch.compile(rig.model, backend=backend)
        torch.testing.assert_close(compiled(rig.x), rig.reference)
        # wait(0) at the top; wait(L + 1) right after layer L's attention; the prefetch that
        # follows layer L's last weight use right before layer L + 1's attention; the last
        # layer's at the end. Each second-of-pair layer is still copied in before its wait.
        pieces = [ops_in(i) for i in backend.items if i.is_splitting_graph and ops_in(i)]
        expected = [(WAIT, 0)]
        for layer in range(N):
            expected += [(PREFETCH, partner(layer - 1, N))] if layer > 0 else []
            expected += [(WAIT, layer + 1)] if layer + 1 < N else []
        expected.append((PREFETCH, partner(N - 1, N)))
        assert [op for piece in pieces for op in piece] == expected
        # Every attention piece holds its attention op, and no compute piece holds an op.
        attention = [i for i in backend.items if i.is_splitting_graph and has(i, ATTENTION)]
        assert len(attention) == N
        assert all(not ops_in(i) for i in backend.items if not i.is_splitting_graph)
    finally:
        rig.close()


def test_compiled_pieces_are_stock_pieces(wrapped: LayerPrefetchPass) -> None:
    """Inductor gets exactly stock's pieces (same nodes, inputs and outputs), so it fuses and
    tunes them as stock does and a step at k = 0 computes the same bits."""
    rig = Offloaded()
    try:
        stock = SplitBackend([ATTENTION])
        torch.compile(rig.model, backend=stock)(rig.x)
        torch._dynamo.reset()
        ours = SplitBackend([ATTENTION, *OP_NAMES])
        torch.compile(rig.model, backend=ours)(rig.x)
        pieces = [
            [piece_signature(i) for i in b.items if not i.is_splitting_graph] for b in (stock, ours)
        ]
        assert len(pieces[0]) == N + 1
        assert pieces[1] == pieces[0]
    finally:
        rig.close()


def test_boundaries_kept_when_a_pair_is_too_close(wrapped: LayerPrefetchPass) -> None:
    """N = 2: layer 1's copy, issued after layer 0's last weight use, would move past the
    wait before layer 1 (right after layer 0's attention); the pass keeps the boundaries."""
    torch.manual_seed(0)
    model = ToyDecoder(2).requires_grad_(False)
    x = torch.randn(1, 6, 64)
    backend = SplitBackend([ATTENTION, *OP_NAMES])
    torch.compile(model, backend=backend)(x)
    flat = [op for i in backend.items if i.is_splitting_graph for op in ops_in(i)]
    assert flat == [(WAIT, 0), (PREFETCH, 1), (WAIT, 1), (PREFETCH, 0)]
    graph = next(i for i in backend.items if i.is_splitting_graph and (PREFETCH, 1) in ops_in(i))
    assert not has(graph, ATTENTION)  # a piece of its own, between layer 0 and layer 1


def has(item, op_name: str) -> bool:
    """Whether the piece holds ``op_name``, by vLLM's own split rule."""
    return any(should_split(node, [op_name]) for node in item.graph.graph.nodes)


def piece_signature(item) -> tuple:
    graph = item.graph.graph
    calls = tuple(str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method"))
    inputs = len(graph.find_nodes(op="placeholder"))
    (output,) = graph.find_nodes(op="output")
    return calls, inputs, len(output.all_input_nodes)


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
