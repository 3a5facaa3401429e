"""A toy decoder: N equal layers named ``layers.<i>``, with an opaque attention custom op
standing in for vLLM's (so the compiled graph has the same shape of boundaries)."""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("dynoff_toy::attention", mutates_args=())
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


@toy_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


class ToyLayer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.input_norm = nn.Parameter(torch.ones(dim))
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_norm = nn.Parameter(torch.ones(dim))
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(self._rms(h, self.input_norm)).chunk(3, dim=-1)
        h = h + self.o_proj(toy_attention(q, k, v))
        gate, up = self.gate_up_proj(self._rms(h, self.post_norm)).chunk(2, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


class ToyDecoder(nn.Module):
    def __init__(self, num_layers: int = 8, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim, bias=False)
        self.layers = nn.ModuleList(ToyLayer(dim, hidden) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h
