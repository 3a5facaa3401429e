"""dynoff: dynamic parameter offloading for vLLM.

Subpackages: ``dynoff.allocator`` (VMM), ``dynoff.compile_pass`` (model executor side),
``dynoff.policy`` (scheduler side). This root module exists so vLLM can resolve the pass from
the string ``"dynoff.LAYER_PREFETCH_PASS"`` (and ``"dynoff.SPLIT_ROUTE_MARKER"``): vLLM
looks names up in the *top-level* package's ``__dict__``, so the objects must live here
(built on import when vLLM is present).
"""

import contextlib

with contextlib.suppress(ImportError):  # vLLM absent: the allocator still works on its own
    from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS, SPLIT_ROUTE_MARKER  # noqa: F401
