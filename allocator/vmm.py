"""Torch-facing API over the VMM arena.

Vocabulary
    page     one physical page of ``page_size`` bytes, one driver handle (2 MiB by default;
             any multiple of the driver's granularity).
    range    a reserved virtual address range of whole pages. Its address never changes. Each
             of its pages reads either a pool page (read-write) or the shared zero page
             (read-only, reads as zeros), so every address of a range is always valid.
    slot     (range, page offset). Mapping a pool page at a slot; unmapping puts the zero page
             back. One pool page at several slots is *aliasing*: writes through one are seen
             through the others.

Every change goes through :meth:`VmmArena.apply`, a transaction: a bad batch raises
``ValueError`` and changes nothing; a driver failure part-way is rolled back and re-raised as
:class:`VmmDriverError`.

Example (host backend, runs anywhere)::

    arena = VmmArena("host")
    arena.create_pages(4)
    r = arena.reserve(2)                      # 2 pages, both read as zeros
    (p,) = arena.allocate_pages(1)
    arena.map(r, [0], [p])
    t = r.tensor(torch.float16, (2, 512))     # any shape/dtype over the range's bytes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dynoff.allocator import _vmm

ZERO_PAGE: int = _vmm.ZERO_PAGE
VmmDriverError = _vmm.VmmDriverError
PagePoolExhausted = _vmm.PagePoolExhausted
Op = tuple["VmmRange", int, int]


@dataclasses.dataclass(frozen=True)
class ArenaStats:
    """Page accounting and driver-call counters of one arena.

    Sizes are in pages of ``page_size`` bytes; ``*_us`` fields are cumulative wall time in
    microseconds spent inside driver calls since the last :meth:`VmmArena.reset_stats`.
    """

    backend: str
    page_size: int
    pages_total: int
    pages_free: int
    ranges: int
    calls: dict[str, float]

    @property
    def pages_allocated(self) -> int:
        return self.pages_total - self.pages_free

    @property
    def bytes_allocated(self) -> int:
        return self.pages_allocated * self.page_size


class VmmRange:
    """A reserved virtual range of ``num_pages`` pages at a fixed address ``ptr``.

    Views made with :meth:`tensor` keep the range alive; the range is released (its slots
    unmapped, its address freed) when neither this object nor any view references it.
    """

    def __init__(self, arena: VmmArena, handle: _vmm.Range) -> None:
        self.arena = arena
        self._handle = handle

    @property
    def ptr(self) -> int:
        return int(self._handle.ptr)

    @property
    def num_pages(self) -> int:
        return int(self._handle.num_pages)

    @property
    def nbytes(self) -> int:
        return int(self._handle.nbytes)

    def mapping(self) -> list[int]:
        """Pool page id behind each page of the range; ``ZERO_PAGE`` where unmapped."""
        return list(self._handle.mapping())

    def bytes(self) -> torch.Tensor:
        """The whole range as a flat ``uint8`` tensor ``[nbytes]`` on the arena's device."""
        if self.arena.backend == "host":
            # frombuffer holds a reference to the exporter (the C++ range) for the tensor's life.
            return torch.frombuffer(self._handle, dtype=torch.uint8)
        return torch.as_tensor(_CudaBytes(self._handle), device=self.arena.torch_device)

    def tensor(
        self, dtype: torch.dtype, shape: Sequence[int], offset_bytes: int = 0
    ) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over bytes ``[offset_bytes, offset_bytes + size)``.

        ``offset_bytes`` must be a multiple of the dtype's element size, and the tensor must
        fit inside the range. The view's address is fixed for the range's lifetime.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for dim in shape:
            numel *= int(dim)
        size = numel * itemsize
        if offset_bytes % itemsize:
            raise ValueError(
                f"offset_bytes={offset_bytes} is not a multiple of {dtype}'s size {itemsize}"
            )
        if offset_bytes < 0 or offset_bytes + size > self.nbytes:
            raise ValueError(
                f"a {tuple(shape)} {dtype} tensor at offset {offset_bytes} needs "
                f"{offset_bytes + size} bytes; the range has {self.nbytes}"
            )
        flat = self.bytes()[offset_bytes : offset_bytes + size]
        return flat.view(dtype).view(tuple(int(d) for d in shape))

    def __repr__(self) -> str:
        return f"VmmRange(ptr={self.ptr:#x}, pages={self.num_pages}, backend={self.arena.backend})"


class _CudaBytes:
    """``__cuda_array_interface__`` over a range; torch keeps this object (and so the range)
    alive for as long as the tensor built from it."""

    def __init__(self, handle: _vmm.Range) -> None:
        self._handle = handle
        self.__cuda_array_interface__ = {
            "shape": (int(handle.nbytes),),
            "typestr": "|u1",
            "data": (int(handle.ptr), False),
            "version": 3,
            "strides": None,
            "stream": None,  # no stream to synchronize with: the range has no producer
        }


class VmmArena:
    """Physical page pool plus reserved ranges on one device.

    Args:
        backend: ``"cuda"`` (CUDA driver VMM on ``device``'s primary context), ``"host"``
            (memfd pages, for CPUs and tests), or ``"auto"`` (cuda when torch sees a GPU).
        device: CUDA device ordinal (ignored on the host backend).
        page_size: bytes per page, each page one physical handle. 0 = the default: the
            driver's allocation granularity on CUDA (2 MiB), 2 MiB on the host. On CUDA it
            must be a multiple of the granularity, on the host of the system page. The
            driver charges per mapping, not per byte, so larger pages make a remap of the
            same bytes cheaper (bench/results/vmm_handle_size_h200.json).
        coalesce: issue one unmap / set-access call per run of consecutive slots instead of
            one per slot. Default: off on CUDA, where the driver still charges per mapping and
            the ranged calls measured slower (level transition 54.7 vs 43.7 ms on the H200,
            bench/results/vmm_h200.json); on for the host backend, where they are cheaper.
    """

    def __init__(
        self,
        backend: str = "auto",
        device: int = 0,
        page_size: int = 0,
        coalesce: bool | None = None,
    ) -> None:
        if backend == "auto":
            backend = "cuda" if torch.cuda.is_available() else "host"
        if backend not in ("cuda", "host"):
            raise ValueError(f"backend must be 'cuda', 'host' or 'auto', not {backend!r}")
        if backend == "cuda":
            torch.cuda.init()  # create torch's primary context first: we share it
        if coalesce is None:
            coalesce = backend == "host"
        self._arena = _vmm.Arena(backend, device, page_size, coalesce)
        self.backend: str = backend
        self.torch_device = (
            torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
        )

    @property
    def page_size(self) -> int:
        return int(self._arena.page_size)

    @property
    def coalesce(self) -> bool:
        return bool(self._arena.coalesce)

    @coalesce.setter
    def coalesce(self, on: bool) -> None:
        self._arena.coalesce = on

    def pages_for(self, nbytes: int) -> int:
        """Pages needed to hold ``nbytes`` (rounded up)."""
        return -(-int(nbytes) // self.page_size)

    # -- physical pages -----------------------------------------------------------------------
    def create_pages(self, count: int) -> None:
        """Create ``count`` physical pages in the pool (slow: keep it off the hot path)."""
        self._arena.create_pages(count)

    def trim_pages(self, count: int) -> int:
        """Destroy up to ``count`` free pages at the end of the pool; returns how many went."""
        return int(self._arena.trim_pages(count))

    def allocate_pages(self, count: int) -> list[int]:
        """Take ``count`` free pool pages (ids, ascending). Raises :class:`PagePoolExhausted`."""
        return list(self._arena.allocate_pages(count))

    def free_pages(self, pages: Sequence[int]) -> None:
        """Return pool pages; each must be allocated and mapped nowhere."""
        self._arena.free_pages(list(pages))

    def map_count(self, page: int) -> int:
        """Number of slots a pool page is mapped at."""
        return int(self._arena.map_count(page))

    # -- ranges and batches -------------------------------------------------------------------
    def reserve(self, num_pages: int) -> VmmRange:
        """Reserve a range of ``num_pages`` pages, all reading the zero page."""
        return VmmRange(self, self._arena.reserve(num_pages))

    def apply(self, ops: Sequence[Op], synchronize: bool = False) -> None:
        """Apply ``(range, page_offset, pool_page | ZERO_PAGE)`` ops as one transaction.

        Ops take effect in order: mapping needs the slot unmapped, unmapping needs it mapped.
        ``synchronize`` waits for all queued device work before any page is unmapped.
        """
        self._arena.apply([(r._handle, int(off), int(page)) for r, off, page in ops], synchronize)

    def map(self, r: VmmRange, offsets: Sequence[int], pages: Sequence[int]) -> None:
        """Map ``pages[i]`` at ``offsets[i]`` of ``r`` (one transaction)."""
        if len(offsets) != len(pages):
            raise ValueError(f"{len(offsets)} offsets but {len(pages)} pages")
        self.apply([(r, o, p) for o, p in zip(offsets, pages, strict=True)])

    def unmap(self, r: VmmRange, offsets: Sequence[int], synchronize: bool = False) -> list[int]:
        """Unmap ``offsets`` of ``r``; returns the pool pages that were there (still allocated)."""
        current = r.mapping()
        pages = [current[o] if 0 <= o < len(current) else ZERO_PAGE for o in offsets]
        self.apply([(r, o, ZERO_PAGE) for o in offsets], synchronize)
        return pages

    def alias(
        self,
        src: VmmRange,
        src_offsets: Sequence[int],
        dst: VmmRange,
        dst_offsets: Sequence[int],
        replace: bool = False,
    ) -> list[int]:
        """Map the pool pages behind ``src``'s offsets into ``dst``'s offsets as well.

        With ``replace``, whatever ``dst`` had there is unmapped first, in the same transaction,
        and returned (pages stay allocated; a slot that read the zero page returns ZERO_PAGE).
        """
        if len(src_offsets) != len(dst_offsets):
            raise ValueError(
                f"{len(src_offsets)} source offsets but {len(dst_offsets)} destinations"
            )
        src_map, dst_map = src.mapping(), dst.mapping()
        ops: list[Op] = []
        displaced: list[int] = []
        for s, d in zip(src_offsets, dst_offsets, strict=True):
            if not 0 <= s < len(src_map):
                raise ValueError(f"source offset {s} out of range [0, {len(src_map)})")
            if src_map[s] == ZERO_PAGE:
                raise ValueError(f"source offset {s} is unmapped: nothing to alias")
            old = dst_map[d] if 0 <= d < len(dst_map) else ZERO_PAGE
            if replace and old != ZERO_PAGE:
                ops.append((dst, d, ZERO_PAGE))
            displaced.append(old)
            ops.append((dst, d, src_map[s]))
        self.apply(ops, synchronize=replace)
        return displaced

    def synchronize(self) -> None:
        """Wait for all work queued on the device (no-op on the host)."""
        self._arena.synchronize()

    # -- accounting ---------------------------------------------------------------------------
    def stats(self) -> ArenaStats:
        return ArenaStats(
            backend=self.backend,
            page_size=self.page_size,
            pages_total=int(self._arena.num_pages),
            pages_free=int(self._arena.num_free_pages),
            ranges=int(self._arena.num_ranges),
            calls=dict(self._arena.stats()),
        )

    def reset_stats(self) -> None:
        self._arena.reset_stats()

    def _inject_failure(self, after: int, count: int = 1) -> None:
        """Test hook: the ``after``-th driver call from now fails (0 = the next), and so do
        the ``count`` - 1 calls after it; -1 disarms."""
        self._arena._inject_failure(after, count)
