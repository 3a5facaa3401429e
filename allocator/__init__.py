"""VMM allocator: fixed virtual addresses, movable physical pages.

GPU memory moves between model weights and the KV cache by remapping 2 MiB physical pages
under virtual ranges that never move, so captured CUDA graphs stay valid. The C++ extension
(``dynoff.allocator._vmm``, built from ``csrc/``) does the page tables; this package gives it a
torch-facing API. See :mod:`dynoff.allocator.vmm`.
"""

from dynoff.allocator.vmm import (
    ZERO_PAGE,
    ArenaStats,
    PagePoolExhausted,
    VmmArena,
    VmmDriverError,
    VmmRange,
)

__all__ = [
    "ZERO_PAGE",
    "ArenaStats",
    "PagePoolExhausted",
    "VmmArena",
    "VmmDriverError",
    "VmmRange",
]
