"""The process-wide state the custom ops read at run time: the current depth and the engine.

The compiled graph bakes in only layer indices; the depth k lives here, so changing it
needs no recompilation and no re-capture. With no runtime installed the ops do nothing.
"""

from __future__ import annotations

from typing import Protocol


class Engine(Protocol):
    restoring: set[int]

    def wait(self, layer: int) -> None: ...
    def prefetch(self, layer: int) -> None: ...
    def share(self, resident: int, aliased: int) -> None: ...
    def unshare(self, resident: int, restored: int) -> None: ...


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
        # Every layer whose op ran at least once, offloaded or not: proof that the compiled
        # model holds the ops (a cached graph skips the pass, so its log is no proof).
        self.seen: dict[str, set[int]] = {"wait": set(), "prefetch": set()}
        # Graph dispatches while the ops had to run: piecewise, and FULL (a bug: the
        # guard the GPU end-to-end test reads through ``dynoff_dispatches``).
        self.dispatches = {"piecewise_needed": 0, "full_while_needed": 0}

    def observe_dispatch(self, needed: bool, full: bool) -> None:
        if needed:
            self.dispatches["piecewise_needed"] += 1
            self.dispatches["full_while_needed"] += int(full)

    def set_level(self, level: int) -> None:
        """Depth ``level`` from the next op on; the engine's ledger follows the pairs the
        weights' remap (``WeightPlacement``) has just shared or separated."""
        from dynoff.compile_pass.pairing import half

        h = half(self.num_layers)
        for i in range(self.level, level):  # raised: i + h aliases i's pages
            self.engine.share(i, i + h)
        for i in range(level, self.level):  # lowered: i + h restored from the host
            self.engine.unshare(i, i + h)
        self.level = level
        self.active = frozenset(
            layer
            for layer in range(self.num_layers)
            if self._is_offloaded(layer, level, self.num_layers)
        )

    def needs_piecewise(self) -> bool:
        """Whether the next step must skip FULL graphs: their ops are baked-in no-ops, and
        at k > 0, or while a restore copy is in flight, the ops must run."""
        return self.level > 0 or self.force_piecewise or bool(self.engine.restoring)

    def missing_ops(self, level: int) -> dict[str, list[int]]:
        """The layers offloaded at ``level`` whose wait or prefetch op has never run."""
        needed = {
            layer
            for layer in range(self.num_layers)
            if self._is_offloaded(layer, level, self.num_layers)
        }
        missing = {op: sorted(needed - seen) for op, seen in self.seen.items()}
        return {op: layers for op, layers in missing.items() if layers}


_runtime: OffloadRuntime | None = None


def install(runtime: OffloadRuntime | None) -> None:
    """Make ``runtime`` the one the ops consult (None: ops become no-ops)."""
    global _runtime
    _runtime = runtime


def current() -> OffloadRuntime | None:
    return _runtime
