"""Weights that make a token-identity check able to fail, and its negative control.

Both are functions for ``LLM.collective_rpc``: each runs on every worker, stock vLLM's and
the plugin's alike, after the engine started (graphs captured, level 0).

* :func:`distinct_weights`: vLLM's ``load_format="dummy"`` seeds every parameter alike
  (``initialize_dummy_weights``: the values depend only on a tensor's size and dtype), so
  every decoder layer gets the *same* weights, of magnitude 1e-3: a layer that runs on its
  partner's weights computes exactly the same thing, and identity checks cannot see it.
  This gives each decoder layer's matrices their own values (seeded by layer and name),
  scaled like a trained model's (standard deviation 1 / sqrt(fan-in)), and sets every
  norm's weight to 1 (the dummy ones, ~1e-3, would scale each layer's input, and so its
  contribution, down a thousandfold), so every layer moves the residual stream. On the
  plugin's workers it also refreshes the pinned host copies the layers are prefetched and
  restored from.
* :func:`wrong_partner`: the negative control. The plugin's prefetch engine copies each
  offloaded layer's *partner* into the shared region, keeping its ledger's belief that the
  layer is there: at k > 0 layers run on wrong weights and nothing else notices. With
  distinct weights, outputs must then differ from stock's.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


@torch.no_grad()
def distinct_weights(worker: Any, seed: int = 0) -> int:
    """Re-draw every decoder layer's matrices, distinct per layer; returns how many."""
    from dynoff.compile_pass.worker_base import find_decoder_layers

    model = worker.model_runner.get_model()
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.data.fill_(1.0)
    layers = find_decoder_layers(model)
    drawn = 0
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param.dim() < 2:
                continue  # norms (set to 1 above) and biases
            generator = torch.Generator(device="cpu").manual_seed(_seed(seed, index, name))
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.data.copy_(values.mul_(param.shape[-1] ** -0.5).to(param.dtype))
            drawn += 1
    state = getattr(worker, "_dynoff", None)
    if state is not None:  # the plugin: its host copies must hold the new values
        placement = state.placement
        if placement.level != 0:
            raise RuntimeError("distinct_weights needs level 0 (every layer in its own pages)")
        for pack in placement.offloadable().values():
            pack.cpu.copy_(pack.flat)
    return drawn


def wrong_partner(worker: Any) -> int:
    """Make the plugin's prefetch and restore copies bring each layer's partner's weights
    (the negative control); returns the layers affected."""
    from dynoff.compile_pass.pairing import partner

    engine = worker._dynoff.engine
    sources = dict(engine.sources)
    num_layers = worker._dynoff.placement.num_layers
    for layer in sources:
        other = partner(layer, num_layers)
        if other is not None and other in sources:
            engine.sources[layer] = sources[other]
    return len(sources)


class IdentityCheckExtension:
    """``worker_extension_cls="bench.weights.IdentityCheckExtension"``: vLLM mixes these
    into every worker class, stock's and the plugin's, so ``LLM.collective_rpc`` reaches
    them by name (a function would need pickle-based serialization switched on)."""

    def dynoff_distinct_weights(self, seed: int = 0) -> int:
        return distinct_weights(self, seed)

    def dynoff_wrong_partner(self) -> int:
        return wrong_partner(self)


EXTENSION = f"{__name__}.{IdentityCheckExtension.__name__}"
