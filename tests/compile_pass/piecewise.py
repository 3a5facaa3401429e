"""A piecewise CUDA-graph runner for the toy decoder, the way vLLM's piecewise mode runs a
model: each layer's compute is one captured graph, and the wait / prefetch ops run eagerly
between replays. Captured once; the graphs bake in the weights' (fixed) VMM addresses."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynoff.compile_pass.ops import PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner
from tests.compile_pass.toy_model import ToyDecoder


def warm_up(forward: Callable[[], None]) -> None:
    """Two eager forwards on a side stream, outside capture (as torch.cuda.graph expects)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)


class PiecewiseRunner:
    def __init__(self, model: ToyDecoder, x: torch.Tensor) -> None:
        self.model = model
        self.x = x.clone()
        self.num_layers = len(model.layers)
        self.h = [torch.empty_like(model.embed(x)) for _ in range(self.num_layers + 1)]
        self.graphs = [torch.cuda.CUDAGraph() for _ in range(self.num_layers + 1)]
        warm_up(self._eager)
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


class FullGraphRunner:
    """The whole forward at one fixed level captured as ONE CUDA graph, the level's copies and
    event waits inside it (the way vLLM's static ``PrefetchOffloader`` captures its copies).

    The copy stream forks from and joins the capture through events; the copies of layers
    i < k for the *next* step are joined before the graph ends, so a replay starts with every
    region holding its first occupant and needs no wait on work outside the graph."""

    def __init__(self, model: ToyDecoder, x: torch.Tensor, engine: object) -> None:
        self.model = model
        self.engine = engine
        self.x = x.clone()
        self.num_layers = len(model.layers)
        self.out = torch.empty_like(model.embed(x))
        self.graph = torch.cuda.CUDAGraph()
        warm_up(self._forward)
        torch.cuda.synchronize()
        self.engine.synchronize()  # type: ignore[attr-defined]
        with torch.cuda.graph(self.graph):
            self._forward()

    def _forward(self) -> None:
        h = self.model.embed(self.x)
        for layer in range(self.num_layers):
            WAIT(h, layer)
            h = self.model.layers[layer](h)
            other = partner(layer, self.num_layers)
            if other is not None:
                PREFETCH(h, other)
        self.out.copy_(h)
        copy_stream = getattr(self.engine, "copy_stream", None)
        # Join the copies issued for the next step. At k = 0 none were issued, and the copy
        # stream is not part of the capture: an event recorded on it would break the capture.
        if copy_stream is not None and self.engine.pending:  # type: ignore[attr-defined]
            torch.cuda.current_stream().wait_stream(copy_stream)
        self.engine.pending.clear()  # type: ignore[attr-defined]

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out
