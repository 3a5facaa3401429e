"""Two ranks (torch.distributed, gloo) applying the same commands to their own host-backend
weights and KV ranges: both change level together; when one rank's resize fails (a driver
fault injected on that rank only), the other rolls back, both report, both keep serving at
the old level; afterwards the weights are bit-exact again."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynoff.compile_pass.levels import gather_all
from dynoff.policy.messages import OffloadCommand
from tests.compile_pass.rigs import host_level_changer
from tests.compile_pass.toy_model import ToyDecoder

WORLD = 2


def rank_main(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # same weights on both ranks, as TP shards would be shaped alike
    model = ToyDecoder(8).requires_grad_(False)
    x = torch.randn(1, 4, 64)
    reference = model(x)
    levels = host_level_changer(rank, model)
    placement, runtime, kv = levels.placement, levels.runtime, levels.kv
    gather = lambda outcomes: gather_all(outcomes, WORLD)  # noqa: E731
    history = []
    commands = [
        (OffloadCommand(0, 1, 1, map_groups=(8, 9)), None),
        (OffloadCommand(1, 2, 2, map_groups=(10, 11)), 1),  # fails on rank 1 only
        (OffloadCommand(2, 3, 2, map_groups=(10, 11)), None),
        (OffloadCommand(3, 4, 1, unmap_groups=(10, 11)), None),
        (OffloadCommand(4, 5, 0, unmap_groups=(8, 9)), None),
    ]
    for command, failing_rank in commands:
        if failing_rank == rank:
            placement.arena._inject_failure(3)  # a driver call part-way through this rank's resize
        outcomes = levels.apply_everywhere(command, gather)
        history.append(
            {
                "command": command.command_id,
                "level": levels.level,
                "runtime_level": runtime.level,
                "oks": sorted((o.rank, o.ok) for o in outcomes),
                "kv_groups": sorted(kv.backed),
            }
        )
    result = {
        "history": history,
        "weights_exact": bool(torch.equal(model(x), reference)),
        "own_pages": placement.packs[4].range.mapping() != placement.packs[0].range.mapping(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_ranks_change_level_together_and_roll_back_together(tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for result in results:
        levels = [h["level"] for h in result["history"]]
        assert levels == [1, 1, 2, 1, 0]  # command 1 failed on rank 1: both stayed at 1
        assert all(h["runtime_level"] == h["level"] for h in result["history"])
        assert result["history"][1]["oks"] == [[0, True], [1, False]]
        assert result["history"][1]["kv_groups"] == list(range(10))  # rolled back
        assert result["history"][2]["kv_groups"] == list(range(12))
        assert result["history"][-1]["kv_groups"] == list(range(8))
        assert result["weights_exact"] and result["own_pages"]
