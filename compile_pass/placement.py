"""Weights under fixed addresses: each decoder layer's parameters packed into one VMM range.

After ``load_model`` (before profiling and graph capture) every layer's parameters are
copied into one range from the allocator and each ``param.data`` becomes a view of it: the
Parameter objects stay, their addresses never change again. Changing the depth remaps pages
under those addresses:

* raise k -> k+1 (pair i = k, j = k + N/2): j's range is aliased onto i's physical pages
  (the shared region) and j's own pages go back to the pool, for the KV cache to take;
* lower k -> k-1: j gets private pages again (from the pool, after the KV cache gave them
  back) and both layers are restored from their pinned CPU copies.

Only a layer's matrices are packed. Its vectors (RMSNorm weights, biases: a few KiB) stay
where vLLM put them, resident and never offloaded: packed, they would spill the matrices'
whole pages into one more page per layer (2 MiB x 64 layers of Qwen3-32B that the KV cache
would lose), and a page of theirs buys no KV.

Packing needs one layer's worth of GPU memory beyond the weights, not twice the decoder: on
CUDA each layer's old storage goes back to the driver (``torch.cuda.empty_cache``) as soon as
its parameters point into the range, before the next layer's pages are created. The peak of
torch-reserved plus VMM bytes over the packing is kept in ``peak_bytes``.

Every offloadable layer keeps a pinned CPU copy (2 layers per level: the seed's "two bytes
of pinned memory per byte reclaimed"), pinned with ``cudaHostRegister`` so host memory is
the weight bytes, not a power-of-two rounding of them.

Page-locked host memory is not free on the GPU: the driver maps it into the device's address
space, 2 MiB of page tables in device memory per GiB (``bench/pinned_cost.py``), which
vLLM's profile counts against the KV cache when the homes are locked before it (0.11 GiB,
30 blocks, for Qwen3-32B's 58 GiB of homes at 0.95 on an H100). So by default
(``pin_homes="first_raise"``) the homes are copied into pageable memory and a level's two
are page-locked when that level is first entered (:meth:`WeightPlacement.lock_level`, 39-64
ms per GiB on an H100); the levels never used cost no device memory. ``pin_homes="start"``
locks them all while packing.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from dynoff.allocator import ZERO_PAGE, VmmArena, VmmRange
from dynoff.compile_pass.pairing import half, pair_index
from dynoff.policy.config import PIN_HOMES

ALIGN = 256  # bytes; every parameter view starts on a 256-byte boundary


class TornPlacementError(RuntimeError):
    """A lowering failed after it mapped the layer's own pages, and sharing the region
    again failed too: the layer's range matches no level."""


class UnequalLayersError(ValueError):
    """The decoder layers differ in size or layout, so they cannot share regions."""


@dataclasses.dataclass
class LayerPack:
    index: int
    nbytes: int
    range: VmmRange
    pages: list[int]
    flat: torch.Tensor  # uint8 [nbytes] over the range
    cpu: torch.Tensor | None = None  # pinned copy, offloadable layers only


def layer_signature(layer: nn.Module) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())


def packed_parameters(layer: nn.Module) -> list[nn.Parameter]:
    """The parameters a layer's pack holds: its matrices (all of them if it has none)."""
    params = [p for _, p in layer.named_parameters()]
    matrices = [p for p in params if p.dim() >= 2]
    return matrices or params


def _layout(layer: nn.Module) -> tuple[list[tuple[nn.Parameter, int]], int]:
    offset, placed = 0, []
    for param in packed_parameters(layer):
        if not _dense(param):  # gaps or overlaps: no copy keeps both its bytes and its views
            name = next(n for n, p in layer.named_parameters() if p is param)
            raise ValueError(
                f"parameter {name} {tuple(param.shape)} has strides {param.stride()}, which "
                "do not tile its elements once each: it cannot be packed with its layout; "
                "serve this model without the plugin"
            )
        placed.append((param, offset))
        offset += -(-param.numel() * param.element_size() // ALIGN) * ALIGN
    return placed, offset


def _dense(param: torch.Tensor) -> bool:
    """Whether ``param``'s strides lay its elements out once each, without gaps: contiguous
    or a permutation of it (a transposed weight), which a packed copy can keep."""
    expected = 1
    for size, stride in sorted(zip(param.shape, param.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


# The NumPy buffer behind each host_empty tensor, by address: lock_host ties the memory's
# unregistration to it. Weak: the entry goes with the buffer.
_OWNERS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def host_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pageable host memory, faulted in by ATen's intra-op threads (``zero_``)
    rather than later by the driver on one thread; :func:`lock_host` page-locks it."""
    owner = np.empty(nbytes, dtype=np.uint8)
    tensor = torch.from_numpy(owner)
    tensor.zero_()
    _OWNERS[tensor.data_ptr()] = owner
    return tensor


def lock_host(tensor: torch.Tensor) -> bool:
    """Page-lock :func:`host_empty`'s memory in place with ``cudaHostRegister`` (the exact
    bytes: the caching host allocator would round a 0.98 GB layer up to 1 GiB), unregistered
    when the memory is freed. Returns whether it locked: CPU-only runs and device tensors
    (the emulated link's homes) have nothing to lock.

    The registration must end before the memory does: a freed range that stays registered
    keeps its mapping in the GPU's address space, and the next ``cudaMalloc`` the driver
    places at that address fails with "resource already mapped". The tensor owns a NumPy
    buffer (``torch.from_numpy``); the buffer's finalizer unregisters it as its last view
    goes, before NumPy frees it."""
    if tensor.device.type != "cpu" or not torch.cuda.is_available():
        return False
    owner = _OWNERS.get(tensor.data_ptr())
    if owner is None or owner.nbytes != tensor.numel() * tensor.element_size():
        raise ValueError("lock_host locks the whole of a host_empty tensor, and this is not one")
    cudart, ptr = torch.cuda.cudart(), tensor.data_ptr()
    rc = cudart.cudaHostRegister(ptr, owner.nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {owner.nbytes} bytes failed ({rc}): page-locking a layer's "
            "host copy needs lockable host memory (`ulimit -l`, the container's memory "
            'limit); give the server more, or set "policy": {"max_level": K} lower'
        )
    # Not at interpreter exit: the CUDA context may be gone, and so is the process.
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr).atexit = False
    return True


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (:func:`host_empty`, :func:`lock_host`)."""
    tensor = host_empty(nbytes)
    lock_host(tensor)
    return tensor


def host_copy(flat: torch.Tensor, lock: bool = True) -> torch.Tensor:
    """A host copy of ``flat`` (a layer's packed bytes: 0.98 GB layers, up to 64 of them for
    Qwen3-32B), page-locked first unless ``lock`` is False: then the device-to-host copy goes
    through the driver's pageable staging, slower, once at start-up."""
    cpu = host_empty(flat.numel())
    if lock:
        lock_host(cpu)
    cpu.copy_(flat.detach())
    return cpu


class WeightPlacement:
    """Packs ``layers`` into VMM ranges of ``arena`` and changes the depth by remapping."""

    def __init__(
        self,
        arena: VmmArena,
        layers: Sequence[nn.Module],
        max_level: int,
        pin_homes: str = "first_raise",
    ) -> None:
        if pin_homes not in PIN_HOMES:
            raise ValueError(f"pin_homes={pin_homes!r}: use one of {PIN_HOMES}")
        self.arena = arena
        self.num_layers = len(layers)
        if not 0 <= max_level <= half(self.num_layers):
            raise ValueError(
                f"max_level={max_level} outside [0, {half(self.num_layers)}] for "
                f"{self.num_layers} layers (pairs are i and i + N/2)"
            )
        signatures = {layer_signature(layer) for layer in layers}
        if len(signatures) > 1:
            sizes = sorted({_layout(layer)[1] for layer in layers})
            raise UnequalLayersError(
                f"decoder layers differ in parameters ({len(signatures)} layouts, sizes "
                f"{sizes} bytes): dynamic offloading needs equal layers to share regions"
            )
        self.max_level = max_level
        self.level = 0
        self.last_copy_ms = 0.0  # time the last lower_level spent restoring layers
        self.peak_bytes = 0  # torch-reserved + VMM bytes at their highest while packing (CUDA)
        self.packs = [self._pack(i, layer) for i, layer in enumerate(layers)]
        at_start = pin_homes == "start"
        for pack in self.packs:
            i = pair_index(pack.index, self.num_layers)
            if i is not None and i < max_level:
                pack.cpu = host_copy(pack.flat, lock=at_start)
        # The levels whose two homes are page-locked (1..locked_levels), and the time the
        # last lock_level spent locking.
        self.locked_levels = max_level if at_start else 0
        self.last_lock_ms = 0.0

    @property
    def layer_bytes(self) -> int:
        return self.packs[0].nbytes

    @property
    def pages_per_layer(self) -> int:
        return len(self.packs[0].pages)

    def _pack(self, index: int, layer: nn.Module) -> LayerPack:
        placed, nbytes = _layout(layer)
        num_pages = self.arena.pages_for(nbytes)
        if self.arena.stats().pages_free < num_pages:
            self.arena.create_pages(num_pages - self.arena.stats().pages_free)
        pages = self.arena.allocate_pages(num_pages)
        vrange = self.arena.reserve(num_pages)
        self.arena.map(vrange, range(num_pages), pages)
        for param, offset in placed:
            # The same strides over its bytes: a layout a kernel prepared at load time (a
            # transposed weight) survives the packing.
            view = vrange.tensor(param.dtype, (param.numel(),), offset).as_strided(
                tuple(param.shape), param.stride()
            )
            view.copy_(param.data)
            param.data = view  # same Parameter object, fixed address from now on
        flat = vrange.tensor(torch.uint8, (nbytes,))
        if flat.is_cuda:
            reserved = torch.cuda.memory_reserved(flat.device)
            self.peak_bytes = max(self.peak_bytes, reserved + self.arena.stats().bytes_allocated)
            torch.cuda.empty_cache()  # the old storage back to the driver, before the next layer
        return LayerPack(index, nbytes, vrange, pages, flat)

    def offloadable(self) -> dict[int, LayerPack]:
        return {p.index: p for p in self.packs if p.cpu is not None}

    def lock_level(self, level: int) -> None:
        """Page-lock the homes of levels up to ``level`` (two layers a level: ``level - 1``
        and its partner), those not locked yet; before a level's first copy, so that its
        prefetches run as DMA, asynchronously. A failure leaves the levels below locked and
        nothing else changed."""
        start, locked = time.perf_counter(), 0
        while self.locked_levels < min(level, self.max_level):
            i = self.locked_levels
            for layer in (i, i + half(self.num_layers)):
                home = self.packs[layer].cpu
                if home is not None and home.device.type == "cpu" and not home.is_pinned():
                    locked += lock_host(home)
            self.locked_levels += 1
        # 0 where nothing was locked (already locked, CPU-only, device homes): no log line
        self.last_lock_ms = (time.perf_counter() - start) * 1e3 if locked else 0.0

    def raise_level(self) -> list[int]:
        """k -> k+1. Returns the pool pages freed (now free in the arena's pool)."""
        if self.level >= self.max_level:
            raise ValueError(f"already at max_level={self.max_level}")
        self.lock_level(self.level + 1)  # before anything changes: a failure leaves k
        displaced = self._share(self.level + half(self.num_layers))
        self.level += 1
        return displaced

    def _share(self, j: int) -> list[int]:
        """Map layer ``j``'s range onto its partner's pages (the shared region); the pages
        ``j`` had go back to the pool, and are returned."""
        n, i = self.pages_per_layer, j - half(self.num_layers)
        displaced = self.arena.alias(
            self.packs[i].range, range(n), self.packs[j].range, range(n), replace=True
        )
        self.arena.free_pages(displaced)
        return displaced

    def lower_level(self, restore: Callable[[int], None] | None = None) -> list[int]:
        """k -> k-1. Takes pages from the pool; returns them (now private to layer j).
        ``restore(j)`` copies layer j back (the prefetch engine's asynchronous copy); by
        default it is copied here, synchronously."""
        if self.level == 0:
            raise ValueError("already at level 0")
        j = self.level - 1 + half(self.num_layers)  # its partner i = level - 1 keeps the region
        n = self.pages_per_layer
        pages = self.arena.allocate_pages(n)
        dst = self.packs[j]
        ops = [(dst.range, o, ZERO_PAGE) for o in range(n)]
        ops += [(dst.range, o, p) for o, p in enumerate(pages)]
        try:
            self.arena.apply(ops, synchronize=True)
        except Exception:
            self.arena.free_pages(pages)
            raise
        # Only j needs its weights: the shared region holds i, because a step at this level
        # ends with prefetch(i) and a raise copies nothing, and the device is idle here (the
        # level change waited for the queued work).
        start = time.perf_counter()
        assert dst.cpu is not None
        try:
            if restore is not None:
                restore(j)
            else:
                dst.flat.copy_(dst.cpu)
                if dst.flat.is_cuda:
                    torch.cuda.synchronize(dst.flat.device)
        except Exception as exc:  # j shares i's region again and the pages go back
            self._share_again(j, exc)
            raise
        self.last_copy_ms = (time.perf_counter() - start) * 1e3
        dst.pages = pages
        self.level -= 1
        return pages

    def _share_again(self, j: int, cause: Exception) -> None:
        """Undo a lowering's mapping of layer ``j``'s own pages (its restore failed with
        ``cause``): ``j`` reads its partner's region again and the pages return to the pool,
        so that the level change can give its KV groups back. Without it the pages stayed
        taken, and the KV undo found the pool empty (the H100's first device-home lowering,
        2026-12-06, whose restore failed: "page pool exhausted ... 0 of 2268 are free")."""
        try:
            self._share(j)
        except Exception as exc:
            raise TornPlacementError(
                f"layer {j}'s restore failed ({type(cause).__name__}: {cause}) and it could not "
                f"share layer {j - half(self.num_layers)}'s region again "
                f"({type(exc).__name__}: {exc})"
            ) from exc
