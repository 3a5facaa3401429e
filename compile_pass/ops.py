"""The custom ops the FX pass inserts: ``dynoff::wait_layer`` and ``dynoff::prefetch_layer``.

Both take a tensor they declare as mutated (``Tensor(a!)``) and a layer index, return
nothing and allocate nothing. The declared mutation is what keeps them in place: every later
reader of that tensor is ordered after the op. They never touch the tensor's data.

    wait_layer(x, L):      the compute stream waits until layer L's weights are resident
                           (also for a resident layer whose restore copy is in flight)
    prefetch_layer(y, P):  issue the copy of layer P into its shared region, ordered after
                           the work already queued (the last use of the region's occupant)

At run time they read the depth from :mod:`.runtime`; for a layer not offloaded at the
current depth they return at once. Listed in ``splitting_ops`` they run eagerly between
captured CUDA-graph pieces; inside a FULL graph they are no-ops baked in at capture.
"""

from __future__ import annotations

import torch

from dynoff.compile_pass import runtime


@torch.library.custom_op("dynoff::wait_layer", mutates_args=("x",))
def wait_layer(x: torch.Tensor, layer: int) -> None:
    rt = runtime.current()
    if rt is None:
        return
    rt.seen["wait"].add(layer)
    if layer not in rt.active and layer not in rt.engine.restoring:
        return
    rt.calls["wait"] += 1
    rt.engine.wait(layer)


@wait_layer.register_fake
def _(x: torch.Tensor, layer: int) -> None:
    return None


@torch.library.custom_op("dynoff::prefetch_layer", mutates_args=("x",))
def prefetch_layer(x: torch.Tensor, layer: int) -> None:
    rt = runtime.current()
    if rt is None:
        return
    rt.seen["prefetch"].add(layer)
    if layer not in rt.active:
        return
    rt.calls["prefetch"] += 1
    rt.engine.prefetch(layer)


@prefetch_layer.register_fake
def _(x: torch.Tensor, layer: int) -> None:
    return None


WAIT = torch.ops.dynoff.wait_layer.default
PREFETCH = torch.ops.dynoff.prefetch_layer.default
OP_NAMES = ("dynoff::wait_layer", "dynoff::prefetch_layer")
