"""A piecewise CUDA-graph runner for the toy decoder, the way vLLM's piecewise mode runs a
model: each layer's compute is one captured graph, and the wait / prefetch ops run eagerly
between replays. Captured once; the graphs bake in the weights' (fixed) VMM addresses."""

from __future__ import annotations

import torch

from dynoff.compile_pass.ops import PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner
from tests.compile_pass.toy_model import ToyDecoder


class PiecewiseRunner:
    def __init__(self, model: ToyDecoder, x: torch.Tensor) -> None:
        self.model = model
        self.x = x.clone()
        self.num_layers = len(model.layers)
        self.h = [torch.empty_like(model.embed(x)) for _ in range(self.num_layers + 1)]
        self.graphs = [torch.cuda.CUDAGraph() for _ in range(self.num_layers + 1)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture
                self._eager()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graphs[0]):
            self.h[0].copy_(model.embed(self.x))
        for layer in range(self.num_layers):
            with torch.cuda.graph(self.graphs[layer + 1]):
                self.h[layer + 1].copy_(model.layers[layer](self.h[layer]))

    def _eager(self) -> None:
        self.h[0].copy_(self.model.embed(self.x))
        for layer in range(self.num_layers):
            self.h[layer + 1].copy_(self.model.layers[layer](self.h[layer]))

    def __call__(self) -> torch.Tensor:
        self.graphs[0].replay()
        for layer in range(self.num_layers):
            WAIT(self.h[layer], layer)
            self.graphs[layer + 1].replay()
            other = partner(layer, self.num_layers)
            if other is not None:
                PREFETCH(self.h[layer + 1], other)
        return self.h[-1]
