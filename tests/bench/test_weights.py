"""The identity check's weights (``bench.weights``), on a toy decoder packed into real
host-backend VMM ranges: distinct per layer, sized like a trained model's, mirrored into
the host copies the plugin copies from; and the negative control that swaps partners."""

from __future__ import annotations

import types

import torch

from bench.weights import distinct_weights, wrong_partner
from dynoff.allocator import VmmArena
from dynoff.compile_pass.placement import WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from tests.compile_pass.toy_model import ToyDecoder

N, DIM, HIDDEN = 8, 64, 128


def worker(model: ToyDecoder, plugin: bool) -> types.SimpleNamespace:
    runner = types.SimpleNamespace(get_model=lambda: model)
    w = types.SimpleNamespace(model_runner=runner)
    if plugin:
        placement = WeightPlacement(VmmArena("host", page_size=64 << 10), model.layers, 2)
        engine = PrefetchEngine.for_placement(placement)
        w._dynoff = types.SimpleNamespace(placement=placement, engine=engine)
    return w


def test_each_layer_gets_its_own_weights_and_the_host_copies_follow() -> None:
    model = ToyDecoder(N, DIM, HIDDEN).requires_grad_(False)
    torch.nn.init.constant_(model.layers[0].o_proj.weight, 1e-3)  # vLLM-dummy-like
    torch.nn.init.constant_(model.layers[3].post_norm, 1e-3)
    w = worker(model, plugin=True)
    assert distinct_weights(w) == 4 * N  # the four matrices of each layer
    first, second = model.layers[0].down_proj.weight, model.layers[4].down_proj.weight
    assert not torch.equal(first, second)
    assert abs(first.float().std().item() - HIDDEN**-0.5) < 0.2 * HIDDEN**-0.5
    for layer in model.layers:  # norms at 1, so each layer's input is not scaled away
        assert torch.equal(layer.input_norm, torch.ones(DIM))
        assert torch.equal(layer.post_norm, torch.ones(DIM))
    for layer, pack in w._dynoff.placement.offloadable().items():
        assert torch.equal(pack.cpu, pack.flat), layer
    # The same seed draws the same weights in another engine (stock's, here unpacked).
    other = ToyDecoder(N, DIM, HIDDEN).requires_grad_(False)
    distinct_weights(worker(other, plugin=False))
    assert torch.equal(other.layers[4].down_proj.weight, second)


def test_the_negative_control_copies_each_layer_in_with_its_partners_weights() -> None:
    model = ToyDecoder(N, DIM, HIDDEN).requires_grad_(False)
    w = worker(model, plugin=True)
    distinct_weights(w)
    engine = w._dynoff.engine
    own = {layer: src.clone() for layer, src in engine.sources.items()}
    assert wrong_partner(w) == 4  # max level 2: layers 0, 1 and their partners 4, 5
    for layer in (0, 1, 4, 5):
        partner = (layer + N // 2) % N
        assert torch.equal(engine.sources[layer], own[partner])
        assert not torch.equal(engine.sources[layer], own[layer])
