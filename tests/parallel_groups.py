"""ParallelStates for tests: fake positions (no collectives: loading, stage splits in one
process) and real gloo TP groups in spawned processes."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.distributed import GroupCoordinator, ParallelState, rank_layout

CPU = torch.device("cpu")


def fake_parallel_state(
    tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1
) -> ParallelState:
    """This rank's position in a tp x pp layout, with stand-in process groups: fine for
    building and loading a model (and for a stage's forward at TP = 1), never for a
    collective."""
    tp_groups, pp_groups = rank_layout(tp_size, pp_size)
    rank = pp_rank * tp_size + tp_rank
    stand_in = object()

    def group(ranks: list[int]) -> GroupCoordinator:
        return GroupCoordinator(ranks, rank, CPU, stand_in, stand_in)

    tp = group(tp_groups[pp_rank])
    world = group(list(range(tp_size * pp_size)))
    return ParallelState(world=world, tp=tp, pp=group(pp_groups[tp_rank]), ep=tp)


def gloo_tp_state(rank: int, world_size: int, store_path: Path) -> ParallelState:
    """One TP group of every process (gloo over a FileStore); PP of one."""
    import torch.distributed as dist

    store = dist.FileStore(str(store_path), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ranks = list(range(world_size))
    tp = GroupCoordinator(ranks, rank, CPU, dist.group.WORLD, dist.group.WORLD)
    pp = GroupCoordinator([rank], rank, CPU)
    return ParallelState(world=tp, tp=tp, pp=pp, ep=tp)
