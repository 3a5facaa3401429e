"""The process-wide state the custom ops read at run time: the current depth and the engine.

The compiled graph bakes in only layer indices; the depth k lives here, so changing it
needs no recompilation and no re-capture. With no runtime installed the ops do nothing.
"""

from __future__ import annotations

from typing import Protocol


class Engine(Protocol):
    def wait(self, layer: int) -> None: ...
    def prefetch(self, layer: int) -> None: ...


class OffloadRuntime:
    """Depth ``level`` over ``num_layers`` layers, and the engine that moves weights."""

    def __init__(self, num_layers: int, engine: Engine) -> None:
        from dynoff.compile_pass.pairing import is_offloaded

        self.num_layers = num_layers
        self.engine = engine
        self._is_offloaded = is_offloaded
        self.level = 0
        self.force_piecewise = False  # benchmarks: piecewise graphs at k = 0 too
        self.active: frozenset[int] = frozenset()
        self.calls = {"wait": 0, "prefetch": 0}

    def set_level(self, level: int) -> None:
        self.level = level
        self.active = frozenset(
            layer
            for layer in range(self.num_layers)
            if self._is_offloaded(layer, level, self.num_layers)
        )


_runtime: OffloadRuntime | None = None


def install(runtime: OffloadRuntime | None) -> None:
    """Make ``runtime`` the one the ops consult (None: ops become no-ops)."""
    global _runtime
    _runtime = runtime


def current() -> OffloadRuntime | None:
    return _runtime
