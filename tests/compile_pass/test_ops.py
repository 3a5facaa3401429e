"""The custom ops: schemas, fake implementations, no-op fast path, and opcheck."""

from __future__ import annotations

import torch

from dynoff.compile_pass import runtime
from dynoff.compile_pass.ops import PREFETCH, WAIT


class CountingEngine:
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.restoring: set[int] = set()

    def wait(self, layer: int) -> None:
        self.log.append(("wait", layer))

    def prefetch(self, layer: int) -> None:
        self.log.append(("prefetch", layer))

    def share(self, resident: int, aliased: int) -> None:
        self.log.append(("share", aliased))

    def unshare(self, resident: int, restored: int) -> None:
        self.log.append(("unshare", restored))


def test_schemas_declare_the_mutation_and_return_nothing() -> None:
    for op in (WAIT, PREFETCH):
        schema = op._schema
        assert (
            schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
        )
        assert len(schema.returns) == 0


def test_opcheck_passes_on_both_ops() -> None:
    x = torch.randn(4, 8)
    for op in (WAIT, PREFETCH):
        torch.library.opcheck(op, (x, 3))


def test_ops_act_only_on_layers_offloaded_at_the_current_level() -> None:
    engine = CountingEngine()
    rt = runtime.OffloadRuntime(8, engine)
    runtime.install(rt)
    try:
        x = torch.zeros(2)
        WAIT(x, 0)
        PREFETCH(x, 4)
        assert engine.log == []  # level 0: nothing is offloaded
        rt.set_level(1)
        WAIT(x, 0)
        PREFETCH(x, 4)
        WAIT(x, 1)  # layer 1 is resident at level 1
        assert engine.log == [("share", 4), ("wait", 0), ("prefetch", 4)]
        rt.set_level(0)
        assert engine.log[-1] == ("unshare", 4)
        assert torch.equal(x, torch.zeros(2))  # declared mutation, untouched data
    finally:
        runtime.install(None)


def test_a_restore_in_flight_keeps_steps_off_full_graphs_until_its_wait() -> None:
    engine = CountingEngine()
    rt = runtime.OffloadRuntime(8, engine)
    runtime.install(rt)
    try:
        assert not rt.needs_piecewise()
        engine.restoring.add(4)  # a lowering to 0 left layer 4's copy in flight
        assert rt.needs_piecewise()
        WAIT(torch.zeros(1), 4)  # resident at level 0, yet waited for
        assert engine.log == [("wait", 4)]
    finally:
        runtime.install(None)
