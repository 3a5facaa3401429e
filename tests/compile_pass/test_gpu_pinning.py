"""Pinned host copies on the GPU: registered while they live, unregistered when freed.

A host range freed while still registered keeps its mapping in the GPU's address space; the
next ``cudaMalloc`` the driver places there fails with "resource already mapped" (seen on
the H100 and the H200: the device home's test after the piecewise module, whose layers'
host copies were freed registered)."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from dynoff.compile_pass.placement import pinned_empty

pytestmark = pytest.mark.gpu


def registered(ptr: int) -> bool:
    from cuda.bindings import driver  # the driver API: no runtime error state is left

    err, _ = driver.cuMemHostGetFlags(ptr)
    return err == driver.CUresult.CUDA_SUCCESS


def test_a_pinned_host_copy_is_unregistered_when_its_last_view_goes() -> None:
    torch.cuda.init()
    host = pinned_empty(256 << 20)
    ptr, view = host.data_ptr(), host[: 1 << 20]
    assert host.is_pinned() and registered(ptr)
    del host
    gc.collect()
    assert registered(ptr)  # a view still holds the memory
    del view
    gc.collect()
    assert not registered(ptr)
    # The address space it had is usable by the device allocator again.
    torch.empty(512 << 20, dtype=torch.uint8, device="cuda").fill_(1)
    torch.cuda.synchronize()


def test_homes_locked_on_first_entry_take_their_page_tables_only_then() -> None:
    """``pin_homes="first_raise"``: the page tables of page-locked homes (2 MiB of device
    memory per GiB, ``bench/pinned_cost.py``) are taken when a level is first entered, not
    at start-up, where vLLM's profile would count them against the KV cache."""
    from torch import nn

    from dynoff.allocator import VmmArena
    from dynoff.compile_pass.placement import WeightPlacement

    torch.cuda.init()
    layers = [nn.Linear(8192, 8192, bias=False).cuda().requires_grad_(False) for _ in range(16)]
    start = time.perf_counter()
    placement = WeightPlacement(VmmArena("cuda"), layers, max_level=8, pin_homes="first_raise")
    packed_s = time.perf_counter() - start
    homes = placement.offloadable()
    assert len(homes) == 16 and not any(p.cpu.is_pinned() for p in homes.values())
    for pack in homes.values():
        assert torch.equal(pack.cpu[: 1 << 20], pack.flat[: 1 << 20].cpu())
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    placement.raise_level()  # level 1: layers 0 and 8, locked first
    assert homes[0].cpu.is_pinned() and homes[8].cpu.is_pinned() and not homes[1].cpu.is_pinned()
    placement.lock_level(8)  # the rest: 14 homes of 256 MiB
    torch.cuda.synchronize()
    taken = free - torch.cuda.mem_get_info()[0]
    locked_gib = 16 * homes[0].nbytes / 2**30
    print(
        f"first_raise: packed with pageable homes in {packed_s:.2f} s; locking 14 homes "
        f"took {placement.last_lock_ms / (locked_gib * 14 / 16):.1f} ms per GiB and "
        f"{taken / 2**20:.1f} MiB of device memory for {locked_gib:.1f} GiB locked in all"
    )
    assert all(p.cpu.is_pinned() for p in homes.values())
    assert taken >= (1 << 20) * locked_gib / 2  # page tables, now that they are locked
    # A locked home is a DMA source: an asynchronous copy lands its bytes.
    dst = torch.empty_like(homes[5].flat)
    dst.copy_(homes[5].cpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dst, homes[5].flat)
    placement.lower_level()
    assert placement.level == 0 and torch.equal(
        homes[8].flat[: 1 << 20], homes[8].cpu[: 1 << 20].cuda()
    )
