"""Model-executor side of dynamic offloading (``dynoff.compile_pass``).

- :mod:`.ops`        ``dynoff::wait_layer`` / ``dynoff::prefetch_layer`` (+ fake impls)
- :mod:`.fx_pass`    the post-grad FX pass that inserts them at layer boundaries
- :mod:`.pairing`    which layers share a region at depth k
- :mod:`.runtime`    the depth and engine the ops read at run time
- :mod:`.prefetch`   copy stream, events, pinned sources, NVTX ranges
- :mod:`.placement`  weights packed into VMM ranges; raising/lowering the depth by remapping
- :mod:`.config`     the ``compilation_config`` that enables the pass

The pass's invariants and a before/after snippet are at the top of :mod:`.fx_pass`.
"""
