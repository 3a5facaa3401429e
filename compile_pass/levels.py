"""Applying an :class:`OffloadCommand` on one rank, and agreeing on it across ranks.

Every rank gets the same command with the same step's ``SchedulerOutput``, applies it to its
own weights and KV ranges, then all ranks exchange outcomes (``all_gather_object`` on the CPU
group, before the forward). If any rank failed, the ranks that succeeded undo their change,
so all ranks run the step at the same level, the old one; the scheduler sees every rank's
outcome in rank 0's report and keeps the old level too.

raise k -> k+1: alias layer k+N/2 onto layer k's pages, map the freed pages into the tier's
KV groups. lower k+1 -> k: (device idle) unmap the groups, give layer k+N/2 its pages back
and restore it from pinned memory (the shared region already holds layer k) on the copy
stream; the next step waits for that copy only where layer k+N/2 runs. Each step is
a VMM transaction; a failure in the second step undoes the first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from dynoff.allocator.kv_cache import VmmKVCache
from dynoff.compile_pass.placement import LayerPack, TornPlacementError, WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from dynoff.compile_pass.runtime import OffloadRuntime
from dynoff.policy.messages import OffloadCommand, ResizeOutcome
from dynoff.policy.trace import trace_range

logger = logging.getLogger("vllm.dynoff.levels")

DRIVER_CALLS_US = ("map_us", "unmap_us", "set_access_us")

Gather = Callable[[list[ResizeOutcome]], list[ResizeOutcome]]


T = TypeVar("T")


def gather_all(items: list[T], world_size: int, group: object = None) -> list[T]:
    """Every rank's items on every rank, in rank order (``torch.distributed``, a CPU/gloo
    group): resize outcomes after a change, the capacity plans at start-up."""
    import torch.distributed as dist

    gathered: list[list[T]] = [[] for _ in range(world_size)]
    dist.all_gather_object(gathered, items, group=group)
    return [item for rank in gathered for item in rank]


class RanksDivergedError(RuntimeError):
    """A rank could not undo a change the other ranks refused: the ranks disagree on the
    level, so no step may run."""


class TornChangeError(RanksDivergedError):
    """A change failed half-way on this rank and its undo failed too: the rank's weights
    and KV ranges match no level, so reporting a plain failure would let the scheduler hand
    out blocks on pages that are no longer mapped."""


def checksum(flat: torch.Tensor) -> int:
    """A device-side checksum of ``flat``'s bytes (their int64 words summed, wrapping)."""
    words = flat.view(torch.uint8)
    whole = words.numel() // 8 * 8
    return int(words[:whole].view(torch.int64).sum()) + int(words[whole:].sum())


class ChangeAudit:
    """Debug (``audit_changes``): what a level change must leave alone, checked on the
    device. Before the change: a checksum of every mapped KV group and of every resident
    layer's weights. After it, and after its restore copies landed: every group still
    mapped must keep its bytes and every layer resident before and after its weights (no
    forward runs in between, so any change is the change's doing: a page unmapped or
    remapped under live KV or weights, a restore copy landing on it), and every layer a
    lowering restored must hold its home's bytes (its own weights, not its partner's).

    Nothing is remembered from one change to the next: the weights may change between
    changes (a weight reload, a redraw), and the audit compares each change with the
    moment before it and with the homes. About 20 ms a change for 50 GB of KV and 13 GB of
    weights on an H100; off in serving."""

    def __init__(self, changer: LevelChanger) -> None:
        self.kv = {g: self.group(changer.kv, g) for g in changer.kv.backed}
        self.weights = {pack.index: checksum(pack.flat) for pack in self.resident(changer)}

    @staticmethod
    def group(kv: VmmKVCache, group: int) -> int:
        return sum(checksum(view) for view in kv.group_bytes(group))

    @staticmethod
    def resident(changer: LevelChanger) -> list[LayerPack]:
        """The layers holding their own pages at the changer's level."""
        from dynoff.compile_pass.pairing import is_offloaded

        n, level = changer.placement.num_layers, changer.level
        return [p for p in changer.placement.packs if not is_offloaded(p.index, level, n)]

    def check(self, changer: LevelChanger) -> tuple[str, ...]:
        changer.engine.synchronize()  # the lowering's restore copies land first
        wrong = [
            f"KV group {g} changed"
            for g, before in self.kv.items()
            if g in changer.kv.backed and self.group(changer.kv, g) != before
        ]
        for pack in self.resident(changer):
            before = self.weights.get(pack.index)
            if before is not None:
                if checksum(pack.flat) != before:
                    wrong.append(f"layer {pack.index} changed")
            elif pack.cpu is None or checksum(pack.flat) != checksum(pack.cpu):
                wrong.append(f"layer {pack.index} does not hold its own weights")
        return tuple(wrong)


class LevelChanger:
    """One rank's weights, KV cache, engine and runtime, moved together between levels."""

    def __init__(
        self,
        rank: int,
        placement: WeightPlacement,
        kv: VmmKVCache,
        engine: PrefetchEngine,
        runtime: OffloadRuntime,
        device_sync: Callable[[], None] = lambda: None,
    ) -> None:
        self.rank = rank
        self.placement = placement
        self.kv = kv
        self.engine = engine
        self.runtime = runtime
        self.device_sync = device_sync
        self.audit = False  # ``audit_changes``: check every change (:class:`ChangeAudit`)

    @property
    def level(self) -> int:
        return self.placement.level

    def apply(self, command: OffloadCommand) -> ResizeOutcome:
        """Apply locally; on failure this rank stays at its old level."""
        with trace_range(f"dynoff.remap.{self.level}->{command.target_level}"):
            return self._apply(command)

    def _apply(self, command: OffloadCommand) -> ResizeOutcome:
        start = time.perf_counter()
        before = self.placement.arena.stats().calls
        try:
            if command.target_level == self.level + 1:
                # A level's homes are page-locked on its first entry (``pin_homes``
                # "first_raise"), while the queued step still runs. Once in a server's
                # life, so it is not a change's stall: the policy prices it apart
                # (``Calibration.lock_ms``), and the change is timed from here.
                self.placement.lock_level(command.target_level)
                if self.placement.last_lock_ms:
                    start = time.perf_counter()
                    logger.info(
                        "dynamic offload: level %d's homes page-locked on rank %d (%.1f ms, "
                        "its first entry)",
                        command.target_level,
                        self.rank,
                        self.placement.last_lock_ms,
                    )
            self.device_sync()  # no queued step may touch pages we unmap
            self.engine.synchronize()
            synced = time.perf_counter()
            audit = ChangeAudit(self) if self.audit else None
            self.placement.last_copy_ms = 0.0
            if command.target_level == self.level + 1:
                self._raise(command.map_groups)
            elif command.target_level == self.level - 1:
                self._lower(command.unmap_groups)
            elif command.target_level != self.level:
                raise ValueError(
                    f"command {command.command_id} jumps from level {self.level} to "
                    f"{command.target_level}; levels move one at a time"
                )
            self.runtime.set_level(self.level)
            end = time.perf_counter()
            after = self.placement.arena.stats().calls
            driver_us = sum(after[k] - before[k] for k in DRIVER_CALLS_US)
            found = audit.check(self) if audit is not None else ()
            if found:
                logger.error(
                    "dynamic offload: the change to level %d on rank %d altered what it must "
                    "not: %s",
                    self.level,
                    self.rank,
                    "; ".join(found[:8]),
                )
            return ResizeOutcome(
                command.command_id,
                self.rank,
                True,
                remap_ms=(end - start) * 1e3,
                sync_ms=(synced - start) * 1e3,
                driver_ms=driver_us / 1e3,
                copy_ms=self.placement.last_copy_ms,
                slots_changed=int(after["slots_changed"] - before["slots_changed"]),
                audit=found,
            )
        except TornChangeError:
            self.runtime.set_level(self.level)  # the ops follow what the pages really hold
            raise  # no level to serve at: the engine stops, loudly
        except Exception as exc:  # reported; the scheduler keeps the old level
            logger.warning(
                "dynamic offload: command %d failed on rank %d: %s",
                command.command_id,
                self.rank,
                exc,
            )
            return ResizeOutcome(
                command.command_id, self.rank, False, f"{type(exc).__name__}: {exc}"
            )

    def _raise(self, groups: tuple[int, ...]) -> None:
        self.placement.raise_level()
        try:
            self.kv.map_groups(groups)
        except Exception as exc:
            self._undo(self.placement.lower_level, exc, "raising")
            raise

    def _lower(self, groups: tuple[int, ...]) -> None:
        # Lowering restores only layer i + N/2: the shared region must hold layer i.
        i = self.level - 1
        held = self.engine.holds(i)
        if held != i:
            raise RuntimeError(
                f"lowering to level {i}: the region layer {i} shares holds layer {held}'s "
                f"weights, not its own (a step at level {self.level} must end with "
                f"prefetch({i})); nothing was changed"
            )
        self.kv.unmap_groups(groups)
        try:
            self.placement.lower_level(restore=self.engine.restore)
        except TornPlacementError as exc:  # the weights match no level: no undo makes one
            raise self._torn("lowering", exc) from exc
        except Exception as exc:
            self._undo(lambda: self.kv.map_groups(groups), exc, "lowering")
            raise

    def _undo(self, undo: Callable[[], object], cause: Exception, what: str) -> None:
        """Undo the first half of a change whose second half failed with ``cause``; if the
        undo fails too, :class:`TornChangeError`."""
        try:
            undo()
        except Exception as exc:
            raise self._torn(what, cause, exc) from exc

    def _torn(self, what: str, cause: Exception, undo: Exception | None = None) -> TornChangeError:
        undone = (
            f" and could not undo its first half ({type(undo).__name__}: {undo})" if undo else ""
        )
        return TornChangeError(
            f"dynamic offload: rank {self.rank} failed {what} from level {self.level} "
            f"({type(cause).__name__}: {cause}){undone}; its KV groups and weights match no "
            "level, so it stops rather than serve on unmapped pages. Restart the server; if "
            'it recurs, set "policy": {"max_level": 0} and report it'
        )

    def revert(self, command: OffloadCommand, old_level: int) -> None:
        """Undo a command this rank applied because another rank failed it. If the undo
        fails too, this rank stays a level apart from the others, and a tensor-parallel
        step would mix two placements: :class:`RanksDivergedError`, and the engine stops."""
        self.device_sync()
        self.engine.synchronize()
        try:
            if self.level == old_level + 1:
                self._lower(command.map_groups)
            elif self.level == old_level - 1:
                self._raise(command.unmap_groups)
        except Exception as exc:
            self.runtime.set_level(self.level)  # the ops follow what the pages really hold
            raise RanksDivergedError(
                f"dynamic offload: rank {self.rank} could not roll command "
                f"{command.command_id} back to level {old_level} ({type(exc).__name__}: "
                f"{exc}); it is at level {self.level} while the other ranks are at "
                f"{old_level}, and a step would mix the two. Restart the server; if it "
                'recurs, set "policy": {"max_level": 0} and report it'
            ) from exc
        self.runtime.set_level(self.level)

    def apply_everywhere(self, command: OffloadCommand, gather: Gather) -> list[ResizeOutcome]:
        """Apply, exchange outcomes with every rank, and roll back if any rank failed."""
        old_level = self.level
        mine = self.apply(command)
        outcomes = gather([mine])
        if mine.ok and not all(o.ok for o in outcomes):
            self.revert(command, old_level)
            logger.warning(
                "dynamic offload: command %d rolled back on rank %d (failed on %s)",
                command.command_id,
                self.rank,
                [o.rank for o in outcomes if not o.ok],
            )
        return outcomes
