"""Pinned host copies on the GPU: registered while they live, unregistered when freed.

A host range freed while still registered keeps its mapping in the GPU's address space; the
next ``cudaMalloc`` the driver places there fails with "resource already mapped" (seen on
the H100 and the H200: the device home's test after the piecewise module, whose layers'
host copies were freed registered)."""

from __future__ import annotations

import gc

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
