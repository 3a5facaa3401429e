"""Which layers share a GPU region at offload depth k (the seed's layer placement).

N decoder layers, half = ⌊N/2⌋. At depth k (0 ≤ k ≤ half), layers i and i + half share one
region for every i < k; the other N - 2k layers stay resident. Layer i + half is copied in
while layers i+1 .. i+half-1 compute, the longest window a pairing can give. With an odd N
the last layer (N - 1) has no partner and is never offloaded.
"""

from __future__ import annotations


def half(num_layers: int) -> int:
    return num_layers // 2


def partner(layer: int, num_layers: int) -> int | None:
    """The layer sharing ``layer``'s region at a deep enough level, or None (odd N's last)."""
    h = half(num_layers)
    if layer < h:
        return layer + h
    if layer < 2 * h:
        return layer - h
    return None


def pair_index(layer: int, num_layers: int) -> int | None:
    """i of the pair (i, i + half) that ``layer`` belongs to."""
    h = half(num_layers)
    if layer < 2 * h:
        return layer % h
    return None


def is_offloaded(layer: int, level: int, num_layers: int) -> bool:
    """Whether ``layer`` lives in a shared region (and is copied in) at depth ``level``."""
    i = pair_index(layer, num_layers)
    return i is not None and i < level
