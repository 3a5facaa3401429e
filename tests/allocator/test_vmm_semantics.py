"""The VMM arena's semantics, run on every backend: host (CI) and cuda (marked gpu).

What this proves: pages keep their data across remapping; aliasing shares memory; every
unmapped address reads zeros; a batch is all-or-nothing under driver failures injected at
every call; bad input raises ValueError and changes nothing; teardown releases everything.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dynoff.allocator import ZERO_PAGE, PagePoolExhausted, VmmArena, VmmDriverError

MiB = 1 << 20
# (backend, page size): the default page (one granule) and a page of three granules, as the
# level changes use to cut driver calls (a non-power-of-two size, like 30 MiB for Qwen3-32B).
BACKENDS = [
    ("host", 0),
    ("host", 6 * MiB),
    pytest.param(("cuda", 0), marks=pytest.mark.gpu),
    pytest.param(("cuda", 6 * MiB), marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS, ids=lambda p: f"{p[0]}-{p[1] // MiB or 'default'}")
def arena(request: pytest.FixtureRequest) -> VmmArena:
    backend, page_size = request.param
    arena = VmmArena(backend, page_size=page_size)
    assert arena.page_size == (page_size or 2 * MiB)
    arena.create_pages(8)
    return arena


def page_floats(arena: VmmArena) -> int:
    return arena.page_size // 4


def fill(arena: VmmArena, r, offset: int, value: float) -> None:
    view = r.tensor(torch.float32, (page_floats(arena),), offset * arena.page_size)
    view.fill_(value)


def read(arena: VmmArena, r, offset: int) -> torch.Tensor:
    view = r.tensor(torch.float32, (page_floats(arena),), offset * arena.page_size)
    return view.cpu()


def test_fresh_range_reads_zeros(arena: VmmArena) -> None:
    r = arena.reserve(3)
    assert r.mapping() == [ZERO_PAGE] * 3
    assert r.ptr % (2 * MiB) == 0 or arena.backend == "host"  # granule-aligned on CUDA
    assert torch.count_nonzero(r.bytes().cpu()) == 0


def test_map_write_unmap_remap_keeps_data(arena: VmmArena) -> None:
    r = arena.reserve(2)
    pages = arena.allocate_pages(2)
    arena.map(r, [0, 1], pages)
    fill(arena, r, 0, 1.5)
    fill(arena, r, 1, -2.0)
    assert arena.unmap(r, [0, 1]) == pages
    assert torch.count_nonzero(r.bytes().cpu()) == 0  # the zero page again
    arena.map(r, [0, 1], pages[::-1])  # same physical pages, swapped
    assert torch.all(read(arena, r, 0) == -2.0)
    assert torch.all(read(arena, r, 1) == 1.5)


def test_alias_shares_memory_then_diverges(arena: VmmArena) -> None:
    a, b = arena.reserve(2), arena.reserve(2)
    pages = arena.allocate_pages(2)
    arena.map(a, [0, 1], pages)
    arena.alias(a, [0, 1], b, [1, 0])
    assert b.mapping() == [pages[1], pages[0]]
    assert arena.map_count(pages[0]) == 2
    fill(arena, a, 0, 7.0)
    assert torch.all(read(arena, b, 1) == 7.0)  # a write through A is seen through B
    fill(arena, b, 0, 3.0)
    assert torch.all(read(arena, a, 1) == 3.0)
    # Remap B's slot 1 onto a private page: A keeps its data, B sees the new page.
    (private,) = arena.allocate_pages(1)
    displaced = arena.alias(a, [1], b, [1], replace=True)
    assert displaced == [pages[0]]
    fill(arena, b, 1, 9.0)
    assert torch.all(read(arena, a, 1) == 9.0)
    assert torch.all(read(arena, a, 0) == 7.0)
    arena.unmap(b, [1])
    arena.map(b, [1], [private])
    fill(arena, b, 1, 4.0)
    assert torch.all(read(arena, a, 0) == 7.0)


def test_batch_moves_pages_between_ranges_in_one_transaction(arena: VmmArena) -> None:
    weights, kv = arena.reserve(3), arena.reserve(4)
    pages = arena.allocate_pages(3)
    arena.map(weights, range(3), pages)
    fill(arena, weights, 2, 5.0)
    ops = [(weights, o, ZERO_PAGE) for o in range(3)]
    ops += [(kv, 1 + o, p) for o, p in enumerate(pages)]
    arena.apply(ops, synchronize=True)
    assert weights.mapping() == [ZERO_PAGE] * 3
    assert kv.mapping() == [ZERO_PAGE, *pages]
    assert torch.all(read(arena, kv, 3) == 5.0)


@pytest.mark.parametrize("coalesce", [True, False])
def test_every_injected_failure_rolls_back(arena: VmmArena, coalesce: bool) -> None:
    arena.coalesce = coalesce
    src, dst = arena.reserve(4), arena.reserve(4)
    pages = arena.allocate_pages(4)
    arena.map(src, range(4), pages)
    for i in range(4):
        fill(arena, src, i, float(i + 1))
    before = (src.mapping(), dst.mapping())
    # Move pages 1..3 of src to dst 0..2 and unmap src 0: several runs, both access kinds.
    ops = [(src, 0, ZERO_PAGE)]
    ops += [(src, i, ZERO_PAGE) for i in (1, 2, 3)]
    ops += [(dst, i - 1, pages[i]) for i in (1, 2, 3)]
    arena.reset_stats()
    arena.apply(ops)
    calls = arena.stats().calls
    driver_calls = int(calls["map_calls"] + calls["unmap_calls"] + calls["set_access_calls"])
    assert driver_calls >= (7 if coalesce else 21)  # 7 slots change: unmap + map + access each
    undo = [(dst, i - 1, ZERO_PAGE) for i in (1, 2, 3)]
    arena.apply(undo + [(src, i, p) for i, p in enumerate(pages)])
    assert (src.mapping(), dst.mapping()) == before
    for failing_call in range(driver_calls):
        arena._inject_failure(failing_call)
        with pytest.raises(VmmDriverError, match="injected failure"):
            arena.apply(ops)
        assert (src.mapping(), dst.mapping()) == before, f"failure at call {failing_call}"
        for i in range(4):
            assert torch.all(read(arena, src, i) == float(i + 1))
        assert torch.count_nonzero(dst.bytes().cpu()) == 0
    assert arena.stats().calls["rollbacks"] == driver_calls
    arena.apply(ops)  # and the arena still works
    assert dst.mapping()[:3] == pages[1:]


def test_bad_input_is_refused_and_changes_nothing(arena: VmmArena) -> None:
    r = arena.reserve(2)
    (p, q) = arena.allocate_pages(2)
    arena.map(r, [0], [p])
    snapshot = r.mapping()
    cases = [
        ([(r, 1, q), (r, 2, q)], "out of range"),  # a good op first, then a bad one
        ([(r, 1, q), (r, -1, q)], "out of range"),
        ([(r, 1, q), (r, 0, q)], "mapping over a mapped page"),
        ([(r, 1, ZERO_PAGE)], "unmapping an unmapped page"),
        ([(r, 1, q), (r, 1, ZERO_PAGE), (r, 1, ZERO_PAGE)], "unmapping an unmapped page"),
        ([(r, 1, 999)], "no pool page"),
    ]
    free_page = arena.allocate_pages(1)[0]
    arena.free_pages([free_page])
    cases.append(([(r, 1, free_page)], "is free"))
    for ops, message in cases:
        with pytest.raises(ValueError, match=message):
            arena.apply(ops)
        assert r.mapping() == snapshot
        assert arena.map_count(q) == 0
    with pytest.raises(ValueError, match="still mapped"):
        arena.free_pages([p])
    with pytest.raises(ValueError, match="not allocated"):
        arena.free_pages([free_page])
    with pytest.raises(ValueError, match="at least one page"):
        arena.reserve(0)
    with pytest.raises(ValueError, match="not a multiple"):
        r.tensor(torch.float32, (4,), offset_bytes=2)
    with pytest.raises(ValueError, match="needs"):
        r.tensor(torch.float32, (r.nbytes,))
    with pytest.raises(ValueError, match="source offset 1 is unmapped"):
        arena.alias(r, [1], arena.reserve(1), [0])


def test_pool_exhaustion_is_clear_and_atomic(arena: VmmArena) -> None:
    free = arena.stats().pages_free
    with pytest.raises(PagePoolExhausted, match=f"asked for {free + 1} pages, {free} of"):
        arena.allocate_pages(free + 1)
    assert arena.stats().pages_free == free
    assert isinstance(PagePoolExhausted("x"), MemoryError)


def test_teardown_releases_ranges_and_pages(arena: VmmArena) -> None:
    r = arena.reserve(2)
    pages = arena.allocate_pages(2)
    arena.map(r, [0, 1], pages)
    view = r.tensor(torch.uint8, (16,))
    del r
    gc.collect()
    assert arena.stats().ranges == 1  # the view keeps its range alive
    del view
    gc.collect()
    assert arena.stats().ranges == 0
    assert [arena.map_count(p) for p in pages] == [0, 0]
    arena.free_pages(pages)
    assert arena.trim_pages(100) == 8
    assert arena.stats().pages_total == 0


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_page_that_is_not_whole_granules_is_refused(backend: str) -> None:
    granule = 2 * MiB if backend == "cuda" else 4096
    with pytest.raises(ValueError, match="multiple"):
        VmmArena(backend, page_size=3 * granule // 2)


@pytest.mark.parametrize("failures", [1, 2])
def test_a_range_is_never_freed_over_a_page_it_could_not_unmap(
    arena: VmmArena, failures: int
) -> None:
    """A released range's address space goes back to the driver only once every page of it
    is unmapped: freed over a live mapping, it lets a later allocation land there (on CUDA,
    "resource already mapped"). One failure (the ranged unmap) leaves the page-by-page
    fallback to finish; two (that and a page's) leave the range reserved, and counted."""
    r = arena.reserve(3)
    arena.map(r, [1], arena.allocate_pages(1))
    arena.reset_stats()
    arena._inject_failure(0, count=failures)
    del r
    gc.collect()
    stats = arena.stats()
    assert stats.ranges == 0
    assert stats.calls["leaked_reservations"] == failures - 1
    arena._inject_failure(-1)
    again = arena.reserve(3)  # the arena goes on serving either way
    assert again.mapping() == [ZERO_PAGE] * 3
