"""GPU: a CUDA graph captured over a VMM-backed tensor stays valid when the pages behind it are
remapped: replay reads the new physical pages (and the zero page once unmapped) with no
re-capture, because the virtual address never changes."""

from __future__ import annotations

import pytest
import torch

from dynoff.allocator import ZERO_PAGE, VmmArena

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [0, 30 << 20], ids=["2MiB", "30MiB"])
def test_graph_replay_follows_remapped_pages(page_size: int) -> None:
    """Also with multi-granule pages (one 30 MiB handle per page, as a level change of
    Qwen3-32B uses): the graph reads the new handles' bytes across each page's whole span."""
    arena = VmmArena("cuda", page_size=page_size)
    arena.create_pages(4)
    pages = arena.allocate_pages(4)
    x_range, staging = arena.reserve(2), arena.reserve(2)
    arena.map(x_range, [0, 1], pages[:2])
    arena.map(staging, [0, 1], pages[2:])
    n = x_range.nbytes // 4
    x = x_range.tensor(torch.float32, (n,))
    x.fill_(1.0)
    staging.tensor(torch.float32, (n,)).fill_(5.0)
    address = x.data_ptr()

    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(x * 2)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out == 2.0)

    # Swap the physical pages under x: the staging pages (all 5.0) take their place.
    ops = [(x_range, i, ZERO_PAGE) for i in (0, 1)] + [(x_range, i, pages[2 + i]) for i in (0, 1)]
    arena.apply(ops, synchronize=True)
    graph.replay()
    torch.cuda.synchronize()
    assert x.data_ptr() == address
    assert torch.all(out == 10.0)

    # Half unmapped: that half reads the zero page.
    arena.unmap(x_range, [1], synchronize=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out[: n // 2] == 10.0)
    assert torch.all(out[n // 2 :] == 0.0)
