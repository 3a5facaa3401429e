"""The driver's own host pages as an offloaded layer's home, on the GPU.

Memory locked with ``cudaHostRegister`` (or ``cudaHostAlloc``) is mapped into the GPU's
address space at 4 KiB, and those page tables take 2 MiB of device memory per GiB locked
(``bench/results/pinned_cost_h200.json``): with every layer of Qwen3-32B homed, 0.13 GiB
that vLLM's profile takes from the KV cache. The driver's host allocations are mapped at
their 2 MiB granularity."""

from __future__ import annotations

import gc

import pytest
import torch

from dynoff.allocator.vmm import host_memory
from dynoff.compile_pass.placement import registered_empty

pytestmark = pytest.mark.gpu

GIB = 1 << 30


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _device_cost(make) -> int:  # type: ignore[no-untyped-def]
    before = _free()
    held = [make(GIB) for _ in range(4)]
    used = before - _free()
    del held
    gc.collect()
    return used


def test_driver_host_pages_cost_the_device_no_page_tables() -> None:
    torch.cuda.init()
    registered = _device_cost(registered_empty)
    driver = _device_cost(lambda n: host_memory(n, "cuda"))
    assert registered >= 6 << 20, f"4 GiB registered took {registered} bytes of the device"
    assert driver <= 2 << 20, f"4 GiB of the driver's host pages took {driver} bytes"


def test_driver_host_pages_copy_to_the_device_as_the_prefetch_engine_copies() -> None:
    home = host_memory(256 << 20, "cuda")
    source = torch.randint(0, 256, (home.numel(),), dtype=torch.uint8)
    home.copy_(source)  # the CPU fills a home
    region = torch.empty(home.numel(), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        region.copy_(home, non_blocking=True)
    stream.synchronize()
    assert torch.equal(region.cpu(), source)
    region.zero_()  # and back: a lowering restores nothing, but a test reads homes
    home.copy_(region, non_blocking=False)
    assert int(home[: 1 << 20].sum()) == 0


def test_driver_host_pages_are_unmapped_when_their_last_view_goes() -> None:
    from cuda.bindings import driver

    home = host_memory(64 << 20, "cuda")
    ptr, view = home.data_ptr(), home[: 1 << 20]

    def mapped() -> bool:
        err, handle = driver.cuMemRetainAllocationHandle(ptr)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        driver.cuMemRelease(handle)
        return True

    assert mapped()
    del home
    gc.collect()
    assert mapped()  # a view still holds the memory
    del view
    gc.collect()
    assert not mapped()
    torch.empty(512 << 20, dtype=torch.uint8, device="cuda").fill_(1)
    torch.cuda.synchronize()
