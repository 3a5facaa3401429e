"""Model-executor side of dynamic offloading (``dynoff.compile_pass``), in three jobs.

The graph pass (compile time):

- :mod:`.fx_pass`    the FX pass that inserts the ops at layer boundaries (its invariants and
                     a before/after snippet open the file)
- :mod:`.pairing`    which layers share a region at depth k
- :mod:`.config`     the ``compilation_config`` that runs the pass, per route

The runtime (every step, and every level change):

- :mod:`.ops`        ``dynoff::wait_layer`` / ``dynoff::prefetch_layer`` (+ fake impls)
- :mod:`.runtime`    the depth and engine the ops read at run time; graph-dispatch counts
- :mod:`.prefetch`   copy stream, events, pinned sources, the region ledger, NVTX ranges
- :mod:`.placement`  weights packed into VMM ranges; raising/lowering the depth by remapping
- :mod:`.homes`      where offloaded layers live between uses (pinned host, or device memory
                     beyond the budget with paced copies: the fast-link emulation)
- :mod:`.levels`     one rank's level change as a transaction, agreed across ranks
- :mod:`.timing`     per-step forward times (CUDA events)
- :mod:`.calibrate`  the start-up measurements the policy prices with

The vLLM integration (start-up and the per-step hooks):

- :mod:`.worker_base` the worker mixin: packing, KV sizing, commands, reports, guards
- :mod:`.worker` / :mod:`.cpu_worker`  the ``--worker-cls`` classes (CUDA, vLLM's CPU engine)
- :mod:`.plugin`     the ``vllm.general_plugins`` entry point (registers the ops)
- :mod:`.hacks`      HACK(vllm-0.26.0-private): every private vLLM symbol the worker side
                     touches, with its guard test
"""
