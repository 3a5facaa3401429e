"""The pass, the ops, the prefetch engine and weight placement on a toy decoder (N = 8),
compiled with torch.compile on the CPU, with weights in host-backend VMM ranges.

Proves: one wait and one prefetch per layer, in the right places; output equal to eager at
every depth 0..4 and across changes; depth changes cost no recompilation; and the offloaded
layers really run on weights carried through aliased pages and copied in by the engine
(a run whose copies are suppressed is stopped before a layer runs on its partner's weights)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._dynamo.utils import counters

from dynoff.allocator import VmmArena
from dynoff.compile_pass import runtime
from dynoff.compile_pass.fx_pass import LayerPrefetchPass
from dynoff.compile_pass.ops import PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner
from dynoff.compile_pass.placement import UnequalLayersError, WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine, WrongWeightsError
from tests.compile_pass.toy_model import ToyDecoder, ToyLayer

N = 8
PAGE = 64 << 10


class RecordingPass(LayerPrefetchPass):
    """Keeps a copy of the transformed graph for inspection."""

    def __call__(self, graph: fx.Graph) -> None:
        super().__call__(graph)
        self.nodes = list(graph.nodes)


class Offloaded:
    """Toy model + placement + engine + runtime, compiled once."""

    def __init__(self, copies: bool = True, pin_homes: str = "start") -> None:
        torch.manual_seed(0)
        self.model = ToyDecoder(N).requires_grad_(False)
        self.x = torch.randn(1, 6, 64)
        self.reference = self.model(self.x)
        self.arena = VmmArena("host", page_size=PAGE)
        self.placement = WeightPlacement(
            self.arena, self.model.layers, max_level=N // 2, pin_homes=pin_homes
        )
        self.engine = PrefetchEngine.for_placement(self.placement)
        if not copies:
            self.engine.prefetch = lambda layer: None  # type: ignore[method-assign]
        self.runtime = runtime.OffloadRuntime(N, self.engine)
        runtime.install(self.runtime)
        self.pass_ = RecordingPass()
        self.compiled = torch.compile(
            self.model, options={"post_grad_custom_post_pass": self.pass_}
        )

    def set_level(self, level: int) -> None:
        self.engine.synchronize()
        while self.placement.level < level:
            self.placement.raise_level()
        while self.placement.level > level:
            self.placement.lower_level()
        self.runtime.set_level(level)

    def close(self) -> None:
        runtime.install(None)


@pytest.fixture(autouse=True)
def fresh_compile():
    # A cache hit skips post-grad passes entirely; these tests inspect what the pass did.
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


@pytest.fixture
def offloaded():
    rig = Offloaded()
    yield rig
    rig.close()


def test_one_wait_and_one_prefetch_per_layer_in_place(offloaded: Offloaded) -> None:
    offloaded.compiled(offloaded.x)
    nodes = offloaded.pass_.nodes
    position = {node: i for i, node in enumerate(nodes)}
    waits = [n for n in nodes if n.target == WAIT]
    prefetches = [n for n in nodes if n.target == PREFETCH]
    assert [n.args[1] for n in waits] == list(range(N))
    assert [n.args[1] for n in prefetches] == [partner(layer, N) for layer in range(N)]
    layer_of = offloaded.pass_.layer_of
    for layer in range(N):
        members = [n for n in nodes if n.op == "call_function" and layer_of(n) == layer]
        assert position[waits[layer]] < min(position[n] for n in members)
        # The prefetch follows layer L's last weight use (a compute node, never a view of a
        # weight) and precedes layer L+1.
        anchor = prefetches[layer].args[0]
        assert position[prefetches[layer]] > position[anchor]
        assert not getattr(anchor.target, "is_view", False), anchor
        if layer + 1 < N:
            assert position[prefetches[layer]] < position[waits[layer + 1]]
    # Idempotent: a second run over the transformed graph inserts nothing.
    graph = fx.Graph()
    env: dict = {}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    offloaded.pass_(graph)
    assert sum(n.target == WAIT for n in graph.nodes) == N


def test_output_equals_eager_at_every_level_without_recompiling(offloaded: Offloaded) -> None:
    torch.testing.assert_close(offloaded.compiled(offloaded.x), offloaded.reference)
    graphs, invocations = counters["stats"]["unique_graphs"], offloaded.pass_.invocations
    for level in [1, 2, 3, 4, 2, 0, 4, 1, 0]:
        offloaded.set_level(level)
        for _ in range(2):  # the second step uses copies issued by the first
            out = offloaded.compiled(offloaded.x)
            torch.testing.assert_close(out, offloaded.reference, msg=f"level {level}")
    assert counters["stats"]["unique_graphs"] == graphs
    assert offloaded.pass_.invocations == invocations
    assert offloaded.engine.copies > 0


def test_homes_locked_on_first_entry_serve_every_level_alike() -> None:
    # pin_homes "first_raise": the homes are pageable copies until a level is first entered
    # (page-locking itself is a no-op without CUDA; the GPU test sees the device memory).
    rig = Offloaded(pin_homes="first_raise")
    try:
        placement = rig.placement
        assert placement.locked_levels == 0
        for pack in placement.offloadable().values():
            assert torch.equal(pack.cpu, pack.flat)  # copied at start-up all the same
        seen = []
        for level in [1, 2, 1, 0, 3, 4, 0]:
            rig.set_level(level)
            seen.append(placement.locked_levels)
            out = rig.compiled(rig.x)
            torch.testing.assert_close(rig.compiled(rig.x), out)
            torch.testing.assert_close(out, rig.reference, msg=f"level {level}")
        assert seen == [1, 2, 2, 2, 3, 4, 4]  # locked once, on the way up, never unlocked
        assert placement.last_lock_ms == 0.0  # nothing locks without CUDA: no log line
        placement.lock_level(N)  # beyond max_level: up to it
        assert placement.locked_levels == N // 2
    finally:
        rig.close()


def test_aliasing_carries_the_real_data(offloaded: Offloaded) -> None:
    placement = offloaded.placement
    free_before = offloaded.arena.stats().pages_free
    offloaded.set_level(2)
    packs = placement.packs
    for i in (0, 1):  # layers i and i + 4 read the same physical pages
        assert packs[i + 4].range.mapping() == packs[i].range.mapping()
    assert offloaded.arena.stats().pages_free == free_before + 2 * placement.pages_per_layer
    offloaded.compiled(offloaded.x)
    # After a step the shared region holds layer i again (prefetched for the next step) ...
    assert torch.equal(packs[4].flat, packs[0].cpu)
    # ... and layer 4 ran on its own weights: they passed through that region on the way.
    assert offloaded.runtime.calls["prefetch"] >= 4


def test_without_the_copies_the_layer_refuses_to_run_on_its_partners_weights() -> None:
    # Layer 4 shares layer 0's region at level 1; with its copy suppressed it would run on
    # layer 0's weights and give a wrong output, silently. The engine's ledger stops it.
    rig = Offloaded(copies=False)
    try:
        rig.set_level(1)
        with pytest.raises(WrongWeightsError, match="layer 4 would run on layer 0's weights"):
            rig.compiled(rig.x)
    finally:
        rig.close()


def test_host_copies_hold_each_layers_bytes(offloaded: Offloaded) -> None:
    packs = offloaded.placement.offloadable()
    assert sorted(packs) == list(range(N))
    for pack in packs.values():
        assert pack.cpu is not None and pack.cpu.data_ptr() != pack.flat.data_ptr()
        assert torch.equal(pack.cpu, pack.flat)  # level 0: every layer is still resident


def test_unequal_layers_and_bad_levels_are_refused() -> None:
    with pytest.raises(ValueError, match="pin_homes='later': use one of"):
        WeightPlacement(VmmArena("host", page_size=PAGE), ToyDecoder(N).layers, 1, "later")
    arena = VmmArena("host", page_size=PAGE)
    layers = [ToyLayer(64, 128), ToyLayer(64, 128), ToyLayer(64, 256), ToyLayer(64, 128)]
    with pytest.raises(UnequalLayersError, match="differ in parameters"):
        WeightPlacement(arena, layers, max_level=1)
    with pytest.raises(ValueError, match=r"max_level=3 outside \[0, 2\]"):
        WeightPlacement(arena, [ToyLayer(64, 128) for _ in range(4)], max_level=3)


def test_a_weight_laid_out_for_a_kernel_keeps_its_layout_when_packed() -> None:
    """A transposed weight (the layout some kernels prepare at load time) is packed with its
    own strides, not copied contiguous; one whose strides skip or repeat elements is
    refused, naming it."""
    layers = [ToyLayer(64, 128) for _ in range(4)]
    before = []
    for layer in layers:
        w = layer.down_proj.weight.detach()
        layer.down_proj.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)
        before.append(w.clone())
    placement = WeightPlacement(VmmArena("host", page_size=PAGE), layers, max_level=1)
    for layer, pack, w in zip(layers, placement.packs, before, strict=True):
        packed = layer.down_proj.weight
        assert packed.stride() == (1, 64) and torch.equal(packed, w)
        assert pack.flat.data_ptr() <= packed.data_ptr() < pack.flat.data_ptr() + pack.nbytes
    gapped = [ToyLayer(64, 128) for _ in range(4)]
    for layer in gapped:
        wide = torch.zeros(64, 256)
        layer.down_proj.weight = nn.Parameter(wide[:, ::2], requires_grad=False)
    with pytest.raises(ValueError, match=r"down_proj.weight \(64, 128\) has strides \(256, 2\)"):
        WeightPlacement(VmmArena("host", page_size=PAGE), gapped, max_level=1)


def test_the_runtime_sees_every_layers_ops_only_where_the_pass_inserted_them() -> None:
    # The worker refuses k > 0 at start-up unless every offloadable layer's ops ran once
    # (OpsMissingError): a model compiled without the pass is caught, one with it passes.
    rig = Offloaded()
    try:
        rig.compiled(rig.x)  # level 0: the ops run and return at once
        assert rig.runtime.missing_ops(N // 2) == {}
        plain = runtime.OffloadRuntime(N, rig.engine)
        runtime.install(plain)
        torch.compile(rig.model)(rig.x)  # no pass: no ops
        assert plain.missing_ops(1) == {"wait": [0, 4], "prefetch": [0, 4]}
        assert plain.missing_ops(0) == {}
    finally:
        rig.close()
